"""Launch vLLM-CPU's command line (for ``bench/peers.py``; vLLM is never a Tandem dependency).

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /path/to/vllm-venv/bin/python bench/vllm_cpu.py serve MODEL_DIR --dtype bfloat16 --port 8101

The ``vllm-cpu`` distribution installs the ``vllm`` package, but vLLM asks
``importlib.metadata.version("vllm")``, which only knows the distribution's
name: the lookup is mapped here, at import time, so the processes vLLM spawns
(which import this file again as their main module) see it too. BENCHMARKS.md
("Peers") has the install steps.
"""
import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version_of

if __name__ == "__main__":  # vLLM spawns processes that import this module: start the CLI only once
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
