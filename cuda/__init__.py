"""GPU decoders for kvcodec (Triton), bit-exact with the CPU reference.

Importing this package imports nothing heavy (no Triton, no CUDA):

* :mod:`kvcodec.cuda.backend`: ``resolve_backend`` (cpu|gpu|auto: argument, then
  $KVCODEC_BACKEND, then auto) and ``decode_chunk_gpu`` (same signature as
  ``kvcodec.format.decode.decode_chunk``);
* :mod:`kvcodec.cuda.rans_kernel`: the 32-lane rANS v1 decode kernel;
* :mod:`kvcodec.cuda.dequant_kernels`: quantize / transform / rope / keep
  decodes and the HF / paged output-layout writers;
* :mod:`kvcodec.cuda.compile_check`: compile every kernel for sm_80 / sm_90
  without a GPU and report registers / spills (``python -m kvcodec.cuda.compile_check``).

Under ``TRITON_INTERPRET=1`` (set before Python imports Triton) the gpu
backend runs the real kernels on CPU tensors.
"""
