"""tools/peer-logits' table: Strata's runs against llama.cpp's, one row per model and prompt.

usage: python compare.py OUT_DIR
Reads OUT_DIR/MODEL.PROMPT.{strata,llama}.{json,logits.f32}. Columns: prompt ids equal; the first step's
largest logit difference and the logits' standard deviation; top-1 equal and Strata's margin between its
first two; top-10 overlap; leading greedy tokens equal; the engine's ids against the reference forward's.
"""

import glob
import json
import os
import sys

import numpy as np


def row(base: str) -> str:
    model, prompt = os.path.basename(base).rsplit(".", 1)
    with open(f"{base}.strata.json") as f:
        ours = json.load(f)
    with open(f"{base}.llama.json") as f:
        theirs = json.load(f)
    ours_logits = np.fromfile(f"{base}.strata.logits.f32", dtype=np.float32).astype(np.float64)
    their_logits = np.fromfile(f"{base}.llama.logits.f32", dtype=np.float32).astype(np.float64)
    diff = np.abs(ours_logits - their_logits).max()
    top2 = np.sort(ours_logits)[-2:]
    top10 = len(set(np.argsort(-ours_logits)[:10]) & set(np.argsort(-their_logits)[:10]))
    leading = next((i for i, (a, b) in enumerate(zip(ours["generated"], theirs["generated"])) if a != b),
                   min(len(ours["generated"]), len(theirs["generated"])))
    engine = ours["engine_generated"]
    is_engine_same = ours["engine_prompt_ids"] == ours["prompt_ids"] and engine == ours["generated"][:len(engine)]
    return (f"| {model} | {prompt} | {len(ours['prompt_ids'])} | {'yes' if ours['prompt_ids'] == theirs['prompt_ids'] else 'NO'} "
            f"| {diff:.4f} | {their_logits.std():.3f} | {'yes' if ours_logits.argmax() == their_logits.argmax() else 'no'} "
            f"| {top2[1] - top2[0]:.3f} | {top10}/10 | {leading}/{len(theirs['generated'])} "
            f"| {'yes' if is_engine_same else 'NO'} |")


def main() -> None:
    print("| model | prompt | tokens | ids equal | max logit diff | logit std | top-1 equal | margin | top-10 "
          "| leading greedy | engine = reference |")
    print("| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.strata.json"))):
        base = path[: -len(".strata.json")]
        if os.path.exists(f"{base}.llama.json"):
            print(row(base))


if __name__ == "__main__":
    main()
