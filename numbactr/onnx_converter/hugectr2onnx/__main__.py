"""``python -m numbactr.onnx_converter.hugectr2onnx``: HugeCTR's converter command line (its flags)."""

import argparse

from numbactr.onnx_converter.hugectr2onnx.converter import convert


def main(argv=None) -> None:
    """HugeCTR's converter command line (the same flags)."""
    ap = argparse.ArgumentParser(description="Convert HugeCTR model to ONNX.")
    ap.add_argument("--onnx_model_path", type=str, required=True, help="Output onnx model path")
    ap.add_argument("--graph_config", type=str, required=True, help="HugeCTR graph configuration file")
    ap.add_argument("--dense_model", type=str, required=True, help="HugeCTR dense model")
    ap.add_argument("--convert_embedding", action="store_true", help="Convert sparse embedding or not (optional)")
    ap.add_argument("--sparse_models", nargs="*", help="HugeCTR sparse models (optional)")
    ap.add_argument("--ntp_file", type=str, default=None, help="HugeCTR non-trainable parameters (optional)")
    ap.add_argument("--graph_name", type=str, default="hugectr", help="Graph name for the ONNX model (optional)")
    a = ap.parse_args(argv)
    convert(
        a.onnx_model_path, a.graph_config, a.dense_model, a.convert_embedding, a.sparse_models, a.ntp_file, a.graph_name
    )


if __name__ == "__main__":
    main()
