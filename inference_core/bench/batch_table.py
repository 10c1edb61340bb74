"""The tables `python -m inference_core batch-bench` prints (markdown): the run's settings and a row per batching
mode or transformers row as each is measured, and the request-rate sweep's table (a line per row and rate). Reads
only the report's plain values; "-" where a figure is null (goodput without latency targets, TPOT without a
two-token answer).
"""

from __future__ import annotations

from inference_core.bench.latency import LatencyTargets


def _cell(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(row: dict) -> str:
    return (f"| {row['name']} | {row['requests']} | {row['output_tokens']} | {row['throughput_tokens_per_s']:.1f} | "
            f"{row['ttft_ms_p50']:.0f} | {row['ttft_ms_p95']:.0f} | {row['latency_ms_p50']:.0f} | "
            f"{row['latency_ms_p95']:.0f} | {_cell(row['tpot_ms_p50'], 1)} | {_cell(row['tpot_ms_p95'], 1)} | "
            f"{row['preemptions']} | {row['mean_batch_size']:.2f} | {_cell(row['goodput_requests_per_s'], 3)} | "
            f"{_cell(row['slo_attainment_pct'], 1)} |")


def _targets_words(arguments: dict) -> str:
    return LatencyTargets(arguments.get("slo_ttft_ms"), arguments.get("slo_tpot_ms")).describe()


def format_header(report: dict) -> str:
    """The run's settings and machine, then the table's header; rows follow as they are measured."""
    arguments, machine = report["arguments"], report["machine"]
    gpu = f", {machine['gpu']}" if "gpu" in machine else ""
    return "\n".join([
        f"batch-bench: {arguments['model']} on {arguments['device']} in {arguments['dtype']}"
        f"{_weights_words(arguments)}; {arguments['requests']} "
        f"requests ({arguments.get('arrival', 'burst')}), up to {arguments['max_new_tokens']} new tokens"
        f"{' (' + arguments['output_lengths'] + ')' if arguments.get('output_lengths') else ''}, max-num-seqs "
        f"{arguments['max_num_seqs']}, KV pool {arguments['kv_cache_tokens']} tokens; goodput: "
        f"{_targets_words(arguments)}",
        f"machine: {machine['processor']} ({machine['cpu_capability']}), {machine['cpu_count']} CPUs, "
        f"{machine['threads']} torch threads, torch {machine['torch']}{gpu}",
        "| row | requests | output tokens | tok/s | TTFT p50 ms | TTFT p95 ms | latency p50 ms | latency p95 ms | "
        "TPOT p50 ms | TPOT p95 ms | preemptions | mean batch | goodput req/s | SLO met % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"])


def _weights_words(arguments: dict) -> str:
    quant = arguments.get("quant", "none")  # absent from reports written before --quant
    return "" if quant == "none" else f", our rows quantized ({quant})"


def format_sweep(report: dict) -> str:
    """The sweep's table: a line per row and rate, each row's rates together."""
    lines = [f"sweep (goodput: {_targets_words(report['arguments'])}):",
             "| row | rate req/s | tok/s | latency p95 ms | TTFT p95 ms | TPOT p95 ms | goodput req/s | SLO met % |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['name']} | {row['rate_requests_per_s']:g} | {row['throughput_tokens_per_s']:.1f} | "
              f"{row['latency_ms_p95']:.0f} | {row['ttft_ms_p95']:.0f} | {_cell(row['tpot_ms_p95'], 1)} | "
              f"{_cell(row['goodput_requests_per_s'], 3)} | {_cell(row['slo_attainment_pct'], 1)} |"
              for row in report["sweep"]]
    return "\n".join(lines)
