"""The whole-model logits comparison (strata.bench.logits_error) on the numpy backend: it must find
the engine equal to the reference there, so a wrong alignment of prompt and decode logits fails."""

from gguf import GGMLQuantizationType as QType

from strata.bench import logits_error


def test_numpy_backend_logits_match_the_reference_to_float32(tmp_path):
    rows = logits_error.run_all("numpy", num_prompt=24, num_decode=3, kv_type="f16", formats=(QType.Q8_0,),
                                shape=logits_error.TINY_SHAPE)
    assert [r.fmt for r in rows] == ["Q8_0"]
    assert rows[0].num_vectors == 3 and rows[0].num_argmax_agree == 3
    assert rows[0].max_relative_error < 1e-4
    table = logits_error.format_table(rows, "f16")
    assert "| Q8_0 | f16 | 3 |" in table
