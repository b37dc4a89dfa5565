"""`from hugectr.X import ...` in a script whose only change is `import numbactr as hugectr` (numbactr/hugectr_alias.py)."""

import os
import subprocess
import sys
import textwrap

import numbactr
import numbactr.inference


def _run(code: str, env_extra=None, cwd=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def test_hugectr_submodules_are_numbactrs_own_modules():
    from hugectr.inference import InferenceParams  # noqa: F401 (numbactr is imported above)
    from hugectr.data import DataSourceParams
    import hugectr.tools

    assert InferenceParams is numbactr.inference.InferenceParams
    assert DataSourceParams is numbactr.data.DataSourceParams and hugectr.tools is numbactr.tools
    # numbactr's modules keep their names: nothing was imported a second time under hugectr.*
    assert numbactr.inference.__spec__.name == "numbactr.inference"
    assert InferenceParams.__module__ == "numbactr.inference.params"
    assert not any(
        k.startswith("hugectr.") and sys.modules[k].__name__.startswith("hugectr") for k in list(sys.modules)
    )


def test_a_script_with_only_the_import_changed():
    r = _run("""
        import numbactr as hugectr
        from hugectr.inference import InferenceModel, InferenceParams
        from hugectr.tools import DataGeneratorParams, DataGenerator
        import hugectr.data
        import hugectr2onnx                      # HugeCTR's separately installed ONNX converter
        print(InferenceParams.__module__, hugectr.data.DataSourceParams.__module__, hugectr2onnx.converter.__name__)
        try:
            import hugectr.no_such_module
        except ModuleNotFoundError as e:
            print("missing:", e.name)
    """)
    assert r.returncode == 0, r.stderr
    assert "numbactr.inference.params numbactr.data.source numbactr.onnx_converter.hugectr2onnx.converter" in r.stdout
    assert "missing: hugectr.no_such_module" in r.stdout


def test_switch_off_and_a_real_hugectr_wins(tmp_path):
    r = _run(
        "import numbactr as hugectr\nfrom hugectr.inference import InferenceParams", {"NUMBACTR_HUGECTR_ALIAS": "0"}
    )
    assert r.returncode != 0 and "No module named 'hugectr'" in r.stderr
    (tmp_path / "hugectr").mkdir()
    (tmp_path / "hugectr" / "__init__.py").write_text("REAL = True\n")
    r = _run(
        "import numbactr\nimport hugectr\nprint(hugectr.REAL)",
        {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("True")
