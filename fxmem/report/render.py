"""Renderings of a memory report: the table (as ONNX Runtime prints its plans) and the plot."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the data these functions render (memory.py prints a MemoryReport with them)
    from .model import GraphReport, LoweringRow


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human(nbytes: float) -> str:
    """Bytes in binary units with three significant digits: ``512 B``, ``12.5 KiB``, ``1.10 GiB``
    (never ``0.0 MiB``: a small size keeps a smaller unit)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.0f} {_UNITS[unit]}" if abs(value) >= 100 else f"{value:.3g} {_UNITS[unit]}"


def flops(cost: float) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if cost >= scale:
            return f"{cost / scale:.3g} {prefix}FLOPs"
    return f"{cost:.0f} FLOPs"


def _short(config: str, width: int = 64) -> str:
    """Long cluster ids (a whole layer at level 1) shortened for the table; JSON keeps them whole."""
    return config if len(config) <= width else f"{config[:40]}...{config[-(width - 43):]}"


LEVEL0_USED = "using level 0's plan"  # the planner's note when a level's plan does not lower the peak
LEAST_PEAK_USED = "using the plan of least simulated peak"  # ... and another plan peaks lower
FEWEST_BYTES_USED = "using the plan of fewest kept bytes"  # ... one part of a step: another keeps fewer


def summary(g: GraphReport) -> list[str]:
    """Five lines: the level (and whether it was used as asked), the predicted step peak against
    level 0's and eager's, the kept activations, the recompute cost, the top 3 memory holders."""
    from .modules import holders

    where = f" (compile {g.compile_id})" if g.compile_id else ""
    fallback = next((n for n in g.notes if any(t in n for t in (LEVEL0_USED, LEAST_PEAK_USED, FEWEST_BYTES_USED))),
                    None)
    which = ("level 0's plan" if fallback and LEVEL0_USED in fallback else
             "the fewest-bytes plan" if fallback and FEWEST_BYTES_USED in fallback else "the least-peak plan")
    used = (f"{which} used ({fallback.split(':', 1)[-1].split(';')[0].strip()})"
            if fallback and g.level > 0 else "used as asked")
    b = g.peak_breakdown()
    peak = b["peak"]
    # Level 0 and a plain (eager) partition keep other activations; the rest of the step is the
    # same, so their peaks are this one plus what they keep beyond it (estimates, marked ~).
    level0, eager = peak + g.level0_bytes - g.saved_bytes, peak + g.plain_bytes - g.saved_bytes
    share = f"{100 * g.recompute_cost / g.forward_cost:.0f}% of the forward" if g.forward_cost else "of the forward"
    top = ", ".join(f"{m} {human(n)}" for m, n in holders(g.owners, b["live"])) or "none"
    return [f"fxmem memory plan: graph {g.index}, level {g.level}{where}: {used}",
            f"step peak (predicted): {human(peak)}; level 0 ~{human(level0)}; eager (no recompute) ~{human(eager)}",
            f"kept activations: {human(g.saved_bytes)} (level 0 {human(g.level0_bytes)}, eager {human(g.plain_bytes)})",
            f"recompute cost: {flops(g.recompute_cost)}, {share}" if g.forward_cost
            else f"recompute cost: {flops(g.recompute_cost)}",
            f"largest at the peak ({b['phase']}, at {b['at']}): {top}"]


def _largest(b: dict, owner: dict[str, str], n: int = 4) -> str:
    live = ", ".join(f"{name} ({owner.get(name, '?')}) {human(nbytes)}" for name, nbytes in b["live"][:n])
    more = len(b["live"]) - n
    return f"in the {b['phase']} at {b['at']}; largest alive: {live}" + (f" and {more} more" if more > 0 else "")


def module_lines(g: GraphReport) -> list[str]:
    """Kept and recomputed activations per module, repeated layers folded (``h.*.attn  x12``)."""
    from .modules import folded

    rows = folded(g.modules)
    if not rows:
        return []
    w = max([len(r.module) for r in rows] + [len("module")])
    lines = [f"{'module':{w}s}  count  {'kept':>10s}  {'recomputed':>10s}"]
    lines += [f"{r.module:{w}s}  {r.count:5d}  {human(r.kept_bytes):>10s}  {human(r.recomputed_bytes):>10s}"
              for r in rows]
    return lines


def table(g: GraphReport) -> str:
    """The summary, the activations by module, then the per-cluster table (ONNX Runtime's
    cluster ids: the ``config`` column is the rule that reproduces each row) and the details."""
    w = max([len(_short(r.config)) for r in g.clusters] + [len("config")])
    lines = [*summary(g), "", *module_lines(g), "",
             f"{'config':{w}s}  recomputed  freq  {'saving':>10s}  module / saving per occurrence (formula)"]
    for r in g.clusters:
        lines.append(f"{_short(r.config):{w}s}  {'yes' if r.enabled else 'no':10s}  {r.frequency:4d}  "
                     f"{human(r.saving_bytes):>10s}  {r.module or '?'}: {r.saving_formula}")
    breakdown = g.peak_breakdown()
    peak = breakdown["peak"]
    lines += [
        f"saved activations: {g.saved_bytes:,d} bytes ({human(g.saved_bytes)}) = {g.saved_formula}",
        f"predicted step peak: {peak:,d} bytes ({human(peak)}), {_largest(breakdown, g.owners)}",
        f"recompute cost: {g.recompute_cost:,.0f} FLOPs",
        f"kept without recompute (plain partition): {human(g.plain_bytes)}; level 0 alone: "
        f"{human(g.level0_bytes)}; this plan: {human(g.saved_bytes)}",
        f"rules applied: {', '.join(f'{r[0]} ({r[2]} occurrences)' for r in g.applied_rules) or 'none'}",
    ]
    lines += [f"note: {n}" for n in g.notes]
    if g.in_backward:
        shown = ", ".join(g.in_backward[:4]) + (f" and {len(g.in_backward) - 4} more" if len(g.in_backward) > 4 else "")
        lines.append(f"optimizer step in the backward: {len(g.in_backward)} parameters updated as their gradients "
                     f"are made ({shown}); any other parameter of the optimizer when the backward ends")
    if g.offloaded:
        lines += offload_lines(g)
    if g.lowerings or g.lowering_notes:
        lines += lowering_lines(g.lowerings, g.lowering_notes)
    if g.symbols:
        by_name = sorted(g.symbols.items(), key=lambda kv: kv[1])
        legend = "; ".join(" = ".join([*g.dims(sym), str(g.values.get(sym, "?"))]) for sym, _ in by_name)
        lines.append(f"symbols (at the compiled shape): {legend}")
    return "\n".join(lines)


SHOWN = 8  # offloaded values listed one per line


def offload_lines(g: GraphReport) -> list[str]:
    """The kept values in host memory between the forward and the backward, by module (repeated
    layers folded), then each value with its bytes and the backward op its reload runs before."""
    from .modules import folded

    rows = folded([[module, nbytes, 0] for _, module, nbytes, _, _ in g.offloaded])
    lines = [f"offloaded to host memory: {len(g.offloaded)} kept values, {human(g.host_bytes())} "
             f"(device bytes not counted in the step peak)"]
    w = max([len(r.module) for r in rows] + [len("module")])
    lines += [f"  {'module':{w}s}  values  {'host':>10s}"]
    lines += [f"  {r.module:{w}s}  {r.count:6d}  {human(r.kept_bytes):>10s}" for r in rows]
    lines += [f"  {name} ({module}) {human(nbytes)}, reloaded before {before}"
              for name, module, nbytes, _, before in g.offloaded[:SHOWN]]
    if len(g.offloaded) > SHOWN:
        lines.append(f"  and {len(g.offloaded) - SHOWN} more (GraphReport.offloaded lists them all)")
    return lines


def lowering_lines(rows: list[LoweringRow], notes: list[str]) -> list[str]:
    """The patterns lowered to fused kernels: pattern, count, saved-for-backward bytes saved."""
    w = max([len(r.pattern) for r in rows] + [len("lowered pattern")])
    lines = [f"{'lowered pattern':{w}s}  count  saved for backward (bytes)  fused ops"]
    for r in rows:
        saved = "?" if r.bytes_saved is None else f"{r.bytes_saved:,d}"
        lines.append(f"{r.pattern:{w}s}  {r.count:5d}  {saved:>26s}  {r.replacement}")
        lines += [f"{'':{w}s}    {n}" for n in r.notes]
    if not rows:
        lines.append("(none)")
    return lines + [f"lowering: {n}" for n in notes]


def axes(who: str):
    """A figure and its axes on matplotlib's file backend; ``who`` names the caller in the error
    when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"{who} needs matplotlib: pip install 'fxmem[report]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, 4.4))


def save(fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> str:
    """Label, grid, legend, write ``path``, close."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(g: GraphReport, path: str) -> str:
    fig, ax = axes("MemoryReport.plot")
    pts = sorted({(c, b) for b, c, _ in g.frontier})
    if pts:
        ax.plot([c for c, _ in pts], [b / 2**20 for _, b in pts], "o-", color="tab:blue",
                label="cheapest plan at each recompute weight")
    ax.plot([g.recompute_cost], [g.saved_bytes / 2**20], "*", color="tab:red", markersize=16,
            label=f"chosen (level {g.level})")
    ax.set_xscale("symlog")
    return save(fig, ax, path, "recompute cost (FLOPs)", "saved activations (MiB)",
                f"fxmem: memory vs recompute, graph {g.index}")


def per_example_lines(plans: list[dict]) -> list[str]:
    """One paragraph per per-example region: how it was microbatched, or why it was not."""
    out = []
    for p in plans:
        head = f"per-example region: batch {p['batch_size']}, microbatch_size={p['requested']!r}"
        if not p["chunked"]:
            out.append(f"{head}: not chunked ({p['reason']})")
            continue
        size = "the whole batch at once" if p.get("whole_batch") else f"chunks of {p['microbatch_size']}"
        lines = [f"{head}: runs in {size}",
                 f"  fused: {p['fused_sums']} clip-weighted batch sums as matvecs, "
                 f"{p['fused_norms']} global norms without concatenation"]
        if p["memory_budget"] is not None:
            measured = ", ".join(f"m={m}: {human(b)}" for m, b in sorted(p["measured"].items()))
            lines.append(f"  budget {human(p['memory_budget'])}; measured step peaks {measured}")
        lines += ghost_lines(p.get("ghost") or [])
        out.append("\n".join(lines))
    return out


def ghost_lines(decisions: list[dict]) -> list[str]:
    """Ghost clipping per per-example weight gradient (fxmem/per_example/ghost/): ghost norm +
    book-kept sum, or materialized, and why."""
    if not decisions:
        return []
    n = sum(d["choice"] == "ghost" for d in decisions)
    lines = [f"  ghost clipping: {n} of {len(decisions)} per-example weight gradients never materialized"]
    for d in decisions:
        name = d.get("param") or f"output {d['output']}"
        shape = "x".join(str(x) for x in d["shape"])
        tokens = "" if d.get("tokens") is None else f", T={d['tokens']}"
        lines.append(f"    {name} ({d['kind']}, {shape}{tokens}): {d['choice']} ({d['reason']})")
    return lines
