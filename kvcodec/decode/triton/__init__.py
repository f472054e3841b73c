"""GPU decoders for kvcodec (Triton), bit-exact with the CPU reference.

Importing this package imports nothing heavy (no Triton, no CUDA):

* :mod:`kvcodec.decode.triton.backend`: the ``triton-stages`` and ``triton-fused``
  implementations the registry (:mod:`kvcodec.decode.registry`; the device is
  :mod:`kvcodec.decode.device`'s) dispatches to, and ``decode_chunk_into`` (decode straight into
  an HF per-layer tensor or a paged cache); a whole chunk on the GPU is the registry's
  ``decode_chunk_gpu`` (the arguments of ``Pipeline.decode``);
* :mod:`kvcodec.decode.triton.rans_kernel`: the 32-lane rANS v1 decode kernel;
* :mod:`kvcodec.decode.triton.dequant_kernels`: the fused kernel for the transform-codec
  chain (every lossy preset: dequantize, tokenscale, inverse transform, kept
  tokens, RoPE and the cast in one launch), the per-stage kernels (quantize,
  tokenscale, transform, rope, keep) for other pipelines, and the HF / paged
  output-layout writers;
* :mod:`kvcodec.decode.triton.compile_check`: compile every kernel for sm_80 / sm_90
  without a GPU and report registers / spills (``python -m kvcodec.decode.triton.compile_check``).

Under ``TRITON_INTERPRET=1`` (set before Python imports Triton) the gpu
backend runs the real kernels on CPU tensors.
"""
