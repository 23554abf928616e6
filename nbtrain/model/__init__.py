"""The model a run trains or generates with: the base through `from_pretrained`, LoRA on top, QLoRA's
4/8-bit base, FSDP2 sharding, checkpoints and export, the GPU speed levers, memory per rank, and a tiny model for tests.
"""

import logging

log = logging.getLogger(__name__)


class _NoKernelsNote(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning.

    peft imports bitsandbytes wherever it is installed, and on a CPU with AVX512-BF16 bitsandbytes
    then logs that the optional `kernels` package is missing: twice per process, in every run, 4-bit
    or not. Its own CPU 4-bit kernels work without it (tests/model/test_shard_load.py).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsNote())
