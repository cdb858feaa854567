"""zkern's Triton kernels, one file per op; the engine reaches them only through zkern.ops.

    TRITON_INTERPRET=1 ZKERN_BACKEND=triton python -m pytest tests/kernels/test_triton.py -q   # on a CPU

flatten.py (flatten, unflatten, unflatten_into_), overflow.py (unscale_and_check_), quant.py (quantize,
dequantize, dequant_sum), adam.py (adam_step_). Each reproduces its zkern.reference twin. The package
re-exports nothing, so that `zkern.triton.flatten` stays the module; zkern.ops maps each op to its file.
"""
