"""Coverage-guided fuzzing (atheris/libFuzzer) of the safetensors header and index parsers.

Only CorruptCheckpointError may come out; any other exception, a crash or a hang is a
finding. Bounded runs:

    python fuzz/fuzz_parsers.py -atheris_runs=50000
    python fuzz/fuzz_parsers.py -max_total_time=600      # a longer soak
"""

from __future__ import annotations

import sys

import atheris
import numpy  # noqa: F401 - imported first so that only shardpoint is instrumented
import torch  # noqa: F401

with atheris.instrument_imports(include=["shardpoint"]):
    from shardpoint.errors import CorruptCheckpointError
    from shardpoint.format.index import parse_index
    from shardpoint.format.safetensors import header_length, parse_header


def one_input(data: bytes) -> None:
    # The first byte picks the parser, so both share one corpus.
    if not data:
        return
    body = data[1:]
    try:
        if data[0] % 2:
            parse_index(body, "index.json")
        else:
            n = header_length(body[:8], len(body), "shard")
            parse_header(body[8 : 8 + n], len(body), "shard")
    except CorruptCheckpointError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
