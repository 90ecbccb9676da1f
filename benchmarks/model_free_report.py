"""``benchmarks/model_free.py``'s page (``model-free.md``): the model line and the table of medians over rounds, per
recipe and path, from the report the benchmark measured."""

from __future__ import annotations

from statistics import median

PEER = "llmcompressor"


def model_line(report: dict) -> str:
    if "random_shape" not in report:
        return (
            f"Model `{report['model']}` ({report['weights_mb']:.0f} MB of {report['dtype']} safetensors, the largest "
            f"tensor {report['largest_tensor_mb']:.0f} MB); "
        )
    random = report["random_shape"]
    shape = ", ".join(f"{key} {value}" for key, value in random["shape"].items())
    return (
        f"Random Llama, `benchmarks/peak_rss.py` shape `{random['name']}` ({shape}; untied embeddings), "
        f"{report['params'] / 1e9:.2f} B parameters, {report['weights_mb']:.0f} MB of {report['dtype']} safetensors "
        f"in {report['files']} files, the largest tensor `{report['largest_tensor']}` "
        f"{report['largest_tensor_mb']:.0f} MB; written by `save_random_llama` (bf16, no fp32 copy) in a child "
        f"process in {random['create_s']:.0f} s "
        f"(peak RSS {random['create_peak_rss_mb']:.0f} MB) into a temporary folder, deleted after the run; "
    )


def markdown(report: dict) -> str:
    title = "# Model-free quantization vs the layer walk"
    if "random_shape" in report:
        title += f": a random {report['params'] / 1e9:.1f}B Llama (shape `{report['random_shape']['name']}`)"
    lines = [
        title,
        "",
        f"{model_line(report)}"
        f"{report['machine']}, shared with other jobs; run {report['date']}, rows back to back in this order, "
        f"each a fresh process (peak RSS by GNU time `%M`). {report['threads']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Each cell is the median of {report['repeats']} rounds ({', '.join(report['modes'])} in turn each round); "
        "every round's numbers are in the JSON. Peak RSS over read: what the path holds above the imports.",
        "",
        "| recipe | path | work s | process s | peak RSS MB | peak RSS over read MB | checkpoint MB | work / read |",
        "|---|---|---|---|---|---|---|---|",
    ]
    modes = report["modes"]
    medians = {
        recipe: {mode: {key: median([run[key] for run in rows[mode]]) for key in rows[mode][0]} for mode in modes}
        for recipe, rows in report["recipes"].items()
    }
    for recipe in report["recipes"]:
        for mode in modes:
            row = medians[recipe][mode]
            read = medians[recipe]["read"]
            size = f"{row['checkpoint_mb']:.1f}" if "checkpoint_mb" in row else "-"
            lines.append(
                f"| {recipe} | {mode} | {row['work_s']:.2f} | {row['process_s']:.1f} | {row['peak_rss_mb']:.0f} | "
                f"{row['peak_rss_mb'] - read['peak_rss_mb']:.0f} | {size} | {row['work_s'] / read['work_s']:.1f}x |"
            )
    bound = 2 * report["largest_tensor_mb"]
    for recipe in report["recipes"]:
        verdicts = []
        for mode in modes[1:]:
            over = medians[recipe][mode]["peak_rss_mb"] - medians[recipe]["read"]["peak_rss_mb"]
            verdicts.append(f"{mode} {over:.0f} MB: {'yes' if over <= bound else 'no'}")
        lines += [
            "",
            f"{recipe}: peak RSS over read ≤ 2× the largest tensor ({bound:.0f} MB)? {'; '.join(verdicts)}.",
        ]
    if report.get("skipped"):
        lines += ["", f"Rows left out: {report['skipped']}."]
    if "layer_walk" in modes:
        same = ", ".join(f"{recipe}: {rows['identical']}" for recipe, rows in report["recipes"].items())
        lines += ["", f"Model-free and layer-walk checkpoints identical tensor for tensor (torch.equal): {same}.", ""]
    else:
        lines += ["", "Model-free and layer-walk checkpoints not compared: no layer_walk row.", ""]
    if PEER not in modes:
        return "\n".join([*lines, f"llm-compressor: {report['llm_compressor']}"]) + "\n"
    lines += [
        f"llm-compressor: {report['llm_compressor']}",
        "",
        "| recipe | model_free work s | llmcompressor work s | llmcompressor / model_free | model_free peak RSS MB | "
        "llmcompressor peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for recipe in report["recipes"]:
        ours, peer = medians[recipe]["model_free"], medians[recipe][PEER]
        lines.append(
            f"| {recipe} | {ours['work_s']:.2f} | {peer['work_s']:.2f} | {peer['work_s'] / ours['work_s']:.2f}x | "
            f"{ours['peak_rss_mb']:.0f} | {peer['peak_rss_mb']:.0f} |"
        )
    lines += ["", "llmcompressor / model_free > 1: ours is faster.", ""]
    for recipe, rows in report["recipes"].items():
        found = rows["vs_llmcompressor"]
        names = (
            "the same tensor names"
            if not found["only_ours"] and not found["only_theirs"]
            else f"names differ ({len(found['only_ours'])} only ours, e.g. {found['only_ours'][:2]}; "
            f"{len(found['only_theirs'])} only theirs, e.g. {found['only_theirs'][:2]})"
        )
        lines.append(
            f"- {recipe}: {found['tensors_ours']} tensors ours, {found['tensors_theirs']} llm-compressor's, {names}; "
            f"of the common ones {len(found['dtype_or_shape_differ'])} differ in dtype or shape and "
            f"{len(found['values_differ'])} in value (bit for bit)"
            + (
                f", e.g. {found['values_differ'][:3]}: {found['differing_bytes']} of the {found['compared_bytes']} "
                f"bytes compared differ ({100 * found['differing_bytes'] / found['compared_bytes']:.4f}%)."
                if found["values_differ"]
                else "."
            )
        )
    differing = [key for rows in report["recipes"].values() for key in rows["vs_llmcompressor"]["values_differ"]]
    if differing and report["dtype"] in ("bfloat16", "float16") and all(k.endswith("weight_packed") for k in differing):
        lines += [
            "",
            f"Only `weight_packed` tensors differ (the scales are equal): on this {report['dtype']} model "
            "llm-compressor divides each weight by its scale in the weight's own dtype (its calibration module is "
            f"built in {report['dtype']}), ours in float32 as the layer walk does (`calibration.upcast`), so codes "
            "differ where the rounded quotient crosses a rounding edge. On a random bf16 512x1024 weight (int4, "
            "group 64) its codes equal the bf16 quotient's rounding and ours the exact (float64) quotient's, "
            "checked outside this script.",
        ]
    if "random_shape" in report:
        ignore = (
            "llm-compressor's `ignore` here is `lm_head` and `re:.*embed_tokens$`: this model's embedding is not tied, "
            "but its model-free path targets tensors by name, not module class (`Linear` matches every `.weight` but "
            "norms'), so with `lm_head` alone it would quantize `model.embed_tokens.weight` too, which ours, targeting "
            "linears only, keeps dense: the ignore list makes the two schemes the same."
        )
    else:
        ignore = (
            "llm-compressor's `ignore` here is `lm_head` and `re:.*embed_tokens$`: its model-free path targets tensors "
            "by name, not module class, so with `lm_head` alone it quantizes this tied model's embedding as well (to "
            "int4 for rtn_int4: a 76 MB checkpoint), which ours keeps dense."
        )
    lines += [
        "",
        f'{ignore} It reads a view of the model folder whose config.json lacks `"quantization_config": null` '
        "(llm-compressor 0.14.0.1 fails on it after quantizing).",
    ]
    return "\n".join(lines) + "\n"
