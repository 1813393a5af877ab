"""What every experiment starts from: its configuration (checked, its model present), the prompt
lengths it may run, and the arms' configuration files in the results folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from strata.bench.experiments import arm_config
from strata.bench.experiments.results import Results
from strata.config import Config, load_config
from strata.errors import ExperimentError
from strata.plugins import load_plugins


@dataclasses.dataclass
class Setup:
    config_path: Path
    config: Config
    raw: dict
    results: Results

    @classmethod
    def open(cls, config_path: Path, results: Results) -> Setup:
        config = load_config(config_path)
        arm_config.require_model(config, config_path)
        return cls(Path(config_path), config, arm_config.read_raw(config_path), results)

    def arm_file(self, name: str, *, without: tuple[str, ...] = (), overrides: Mapping[str, Any] | None = None) -> Path:
        """The configuration as given, less ``without``, with ``overrides``, written as configs/<name>.toml."""
        data = arm_config.derive(self.raw, self.config_path.parent.resolve(), without=without, overrides=overrides)
        path = arm_config.write_arm(data, self.results.out_dir / "configs" / f"{name}.toml")
        load_plugins(load_config(path))  # what the schema or a plugin's table refuses stops here, before any run
        return path


def parse_lengths(text: str) -> list[int]:
    """``--prompt-tokens``: comma-separated token counts; ``k`` multiplies by 1,024 (``2k`` = 2,048)."""
    lengths = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        try:
            lengths.append(int(word[:-1]) * 1024 if word.lower().endswith("k") else int(word))
        except ValueError:
            raise ExperimentError(f"--prompt-tokens {text!r}: {word!r} is not a token count (write e.g. 31258 or "
                                  "2k,8k,32k)") from None
    if not lengths or min(lengths) < 1:
        raise ExperimentError(f"--prompt-tokens {text!r}: give one or more positive token counts")
    return lengths


def check_fits(lengths: Sequence[int], gen_tokens: int, context_tokens: int, where: str) -> None:
    """Each prompt and its generated tokens inside the context of the arms' configuration."""
    longest = max(lengths)
    if longest + gen_tokens > context_tokens:
        raise ExperimentError(f"--prompt-tokens {longest:,} plus --gen-tokens {gen_tokens:,} exceed "
                              f"runtime.context_tokens = {context_tokens:,} of {where}; shorten the prompt, generate "
                              "fewer tokens, or raise runtime.context_tokens")
