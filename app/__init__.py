"""The orchestration: the quantize pipeline, mixed precision, bias correction and the command-line tools."""
