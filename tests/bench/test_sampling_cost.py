"""sampling-bench's pieces that need no model: the in-step cost of log-probabilities and the table."""

from __future__ import annotations

from inference_core.bench.sampling_cost import format_table, logprobs_ms


def test_the_in_step_cost_grows_with_the_batch():
    one, eight = logprobs_ms(1, 8192, calls=20), logprobs_ms(8, 8192, calls=20)
    assert 0 < one < eight


def test_the_table_shows_the_in_step_share_and_the_grammar_cost():
    report = {"model": "m", "dtype": "float32", "machine": {"processor": "cpu", "cpu_capability": "AVX512"},
              "rows": [{"what": "top-5 log-probabilities", "batch": 8, "tokens": 64, "a": 10.0, "b": 9.5,
                        "ratio": 0.95, "in_step_ms": 1.2, "in_step_pct": 1.2},
                       {"what": "JSON schema constraint", "batch": 1, "tokens": 40, "a": 25.0, "b": 24.0,
                        "ratio": 0.96, "grammar_ms_per_token": 0.31}]}
    table = format_table(report)
    assert "| 0.950 | 1.20 ms (1.2%) | - |" in table and "| 0.960 | - | 0.310 |" in table
