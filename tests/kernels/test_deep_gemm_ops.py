"""kernels/moe/deep_gemm_ops.py without a GPU: a failed `import deep_gemm` is remembered without the frames of the
call that first tried it (they held a whole engine alive, 2026-12-05)."""

import gc
import weakref

from kernels.moe import deep_gemm_ops


def test_a_failed_import_keeps_no_caller_alive():
    class Holder:  # stands for an engine whose first forward asked for DeepGEMM
        pass

    def first_caller() -> weakref.ref:
        holder = Holder()
        deep_gemm_ops._module()
        return weakref.ref(holder)

    deep_gemm_ops._module.cache_clear()
    try:
        ref = first_caller()
        gc.collect()
        module = deep_gemm_ops._module()
        assert ref() is None
        if isinstance(module, Exception):  # (this machine has no DeepGEMM; a GPU host may)
            assert module.__traceback__ is None and "deep_gemm" in repr(module)
    finally:
        deep_gemm_ops._module.cache_clear()
