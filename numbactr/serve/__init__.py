"""Serving over the network: Triton's KServe v2 inference protocol in front of numbactr's InferenceSession and
parameter server (issue 44). ``numbactr serve --model-repository DIR`` reads a Triton-layout repository of
HugeCTR models and answers NVIDIA's Triton clients unchanged.

pbtxt.py       protobuf's text format (config.pbtxt) as a tree, errors naming file and line
repository.py  the repository: config.pbtxt checked, a version folder loaded into an InferenceSession
protocol.py    KServe v2 request and response bodies, Triton's binary-data extension
infer.py       a request's tensors (DES, CATCOLUMN, ROWINDEX) checked against the model; a batch run
batcher.py     dynamic batching (max_batch_size, preferred_batch_size, max_queue_delay_microseconds)
instances.py   instance_group: a model's further instances as worker processes, each with its own session
metrics.py     Prometheus metrics and the JSON access log
app.py         the HTTP routes (Starlette)
reload.py      live updates: a new version loaded and swapped in, a damaged one reported
refresh.py     live embedding refresh from a newer snapshot's sparse files or an incremental dump
tiers.py       a Redis tier that goes down while serving: RocksDB answers, or 503, until it is back
command.py     ``numbactr serve`` (uvicorn) and ``numbactr serve-export``

This package sits between numbactr.cli and the faces: it imports numbactr.inference, nothing but the
command line imports it.
"""
