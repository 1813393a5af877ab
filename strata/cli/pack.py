"""``strata --config FILE pack``: write the expert pack beside the GGUF, in the backend's encoding.

The engine then reads it straight into pinned memory (``model.expert_pack``) instead of packing
the GGUF's experts at every start.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from strata.config import Config
from strata.errors import ConfigError
from strata.gpu.ledger import VramLedger
from strata.model.gguf_file import open_gguf
from strata.model.locate import resolve_model_path

SUFFIX = ".strpack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help=f"where to write it (default: the GGUF's path with {SUFFIX})")


def run(args: argparse.Namespace, config: Config) -> int:
    from tqdm import tqdm

    from strata.backend.select import make_ops, select_backend
    from strata.engine.memory.expert_pack import ExpertPack

    model = open_gguf(resolve_model_path(config.model.path))
    if not model.spec.is_moe:
        raise ConfigError(f"{model.path.name} is a dense model ({model.spec.arch}); it has no experts to pack")
    ops = make_ops(select_backend(config), VramLedger(1 << 40), config.runtime.device)
    layout = ops.expert_layout(model)
    out = args.out or model.path.with_suffix(SUFFIX)
    started = time.perf_counter()
    with tqdm(total=model.spec.num_layers, desc="packing experts", unit="layer", file=sys.stderr) as bar:
        pack = ExpertPack.from_gguf(model, layout, lambda n: np.empty(n, np.uint8), ops.encode_experts,
                                    lambda done: bar.update(done - bar.n))
    pack.write(out, model)
    print(f"wrote {out}: {pack.num_bytes / 2**30:.2f} GiB, {model.spec.num_layers} layers x "
          f"{model.spec.num_experts} experts of {layout.slot_bytes:,} bytes ({layout.encoding} encoding) "
          f"in {time.perf_counter() - started:.1f} s; set model.expert_pack = \"{out}\"")
    return 0
