"""The printed summary of an engine speed run's results."""

from __future__ import annotations

from typing import Any


def summarize(results: dict[str, Any]) -> str:
    lines = []
    limits = results.get("limits")
    if limits:
        lines.append(f"limits: copy {limits['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s "
                     f"(read+write), matmul {limits['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    engine = results.get("engine")
    if engine:
        lines.append(f"engine: startup {engine['startup_s']:.1f} s, {engine['num_kv_blocks']} "
                     f"KV blocks, {engine['cuda_graph_count']} graphs captured in "
                     f"{engine['cuda_graph_capture_s']:.1f} s "
                     f"({engine['cuda_graph_pool_bytes'] / 2**20:.0f} MiB)")
    for case in results.get("decode", []):
        lines.append(_decode_line("decode", case))
    for case in results.get("mixed", []):
        head = f"mixed b{case['batch']} ctx{case['context']} + {case['prompt_len']}-token prompt"
        if "skipped" in case:
            lines.append(f"{head}: skipped ({case['skipped']})")
            continue
        forward = case["forward_ms"]["median"] if case["forward_ms"] else float("nan")
        lines.append(f"{head}: step {case['step_ms']['median']:.3f} ms (forward {forward:.3f}, "
                     f"graphed {case['graphed_steps']}/{case['timed_steps']}); the batch's "
                     f"decode-only step {case['decode_only_step_ms']['median']:.3f} ms "
                     f"(graphed {case['decode_only_graphed_steps']}/{case['timed_steps']})")
    for case in results.get("prefill", []):
        if "skipped" in case:
            lines.append(f"prefill {case['tokens']}: skipped ({case['skipped']})")
            continue
        frac = case.get("fraction_of_matmul_rate")
        lines.append(
            f"prefill {case['tokens']:>5}: step {case['step_ms']['median']:.1f} ms, forward "
            f"{case['forward_ms']['median']:.1f} ms, {case['achieved_flops_per_s'] / 1e12:.0f} "
            f"TFLOP/s" + (f" = {frac:.0%} of matmul (goal >= 60%)" if frac else ""))
    for case in results.get("small", []):
        lines.append(_decode_line("small " + ("eager " if case["enforce_eager"] else "graphs"),
                                  case) + " (goal < 1.5 ms)")
    e2e, hf = results.get("e2e"), results.get("hf")
    if e2e:
        ours = e2e["ours"]
        lines.append(f"e2e ours: {ours['prompts']} prompts, {ours['output_tokens_per_s']:.0f} "
                     f"out tok/s ({ours['elapsed_s']:.1f} s); on the HF subset "
                     f"{e2e['ours_on_hf_prompts']['output_tokens_per_s']:.0f} out tok/s")
    if hf and "output_tokens_per_s" in hf:
        lines.append(f"e2e HF ({hf['method']}): {hf['prompts']} prompts, "
                     f"{hf['output_tokens_per_s']:.0f} out tok/s ({hf['elapsed_s']:.1f} s)")
    versus = results.get("e2e_vs_hf")
    if versus:
        lines.append(f"e2e ratio ours/HF: {versus['ratio_output_tokens_per_s']:.1f}x "
                     f"(goal >= 5x)")
    for name, error in results.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {error.strip().splitlines()[-1]}")
    lines.append(f"total {results.get('total_s', 0):.0f} s")
    return "\n".join(lines)


def _decode_line(label: str, case: dict[str, Any]) -> str:
    head = f"{label} b{case['batch']} ctx{case['context']}"
    if "skipped" in case:
        return f"{head}: skipped ({case['skipped']})"
    line = (f"{head}: step {case['step_ms']['median']:.3f} ms, forward "
            f"{case['forward_ms']['median']:.3f} ms, host {case['host_ms_median']:.3f} ms, "
            f"graphed {case['graphed_steps']}/{case['timed_steps']}")
    if "roofline_ms" in case:
        line += (f", roofline {case['roofline_ms']:.3f} ms -> {case['step_over_roofline']:.2f}x"
                 f" (forward {case['forward_over_roofline']:.2f}x)")
    if "goal_step_over_roofline" in case and "roofline_ms" in case:
        line += f" (goal <= {case['goal_step_over_roofline']:.2f}x)"
    return line
