"""Serving over the network: Triton's KServe v2 inference protocol in front of numbactr's InferenceSession and
parameter server (issue 44). ``numbactr serve --model-repository DIR`` reads a Triton-layout repository."""
