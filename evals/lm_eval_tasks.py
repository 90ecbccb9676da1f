"""lm-eval integration: our in-memory models scored by lm-eval's own loop, on local tasks or any task the user has.

The model is wrapped by lm-eval's ``HFLM`` as an already-instantiated model and tokenizer, so nothing is fetched from
the hub. The built-in local task is a wikitext-style rolling loglikelihood over our evaluation split, written as a
jsonl plus a task YAML that lm-eval loads through its ``json`` dataset support. Users add tasks by name
(``gate.lm_eval.tasks=[...]``) and their own YAML folders (``gate.lm_eval.include_path=``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

LOCAL_TASK = "compress_eval_rolling"

TASK_YAML = """\
# Written by compress: rolling loglikelihood over the evaluation split (like lm-eval's wikitext task).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_local_task(texts: list[str], folder: Path) -> Path:
    """The task folder (for lm-eval's ``include_path``) holding the evaluation texts and the task YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    data_file = folder / f"{LOCAL_TASK}.jsonl"
    data_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    (folder / f"{LOCAL_TASK}.yaml").write_text(TASK_YAML.format(task=LOCAL_TASK, data_file=json.dumps(str(data_file))))
    return folder


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str],
    include_paths: list[Path],
    limit: int | None,
    batch_size: int,
    max_length: int,
) -> dict:
    """``{task: {"metrics": {name: value}, "higher_is_better": {name: bool}}}`` for one model."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    device = str(next(model.parameters()).device)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size, max_length=max_length)
    # Indexing lm-eval's thousands of built-in task files takes seconds; do it only when a built-in task is asked for.
    builtin = any(task != LOCAL_TASK for task in tasks)
    manager = TaskManager(include_path=[str(path) for path in include_paths] or None, include_defaults=builtin)
    output = lm_eval.simple_evaluate(
        model=wrapped,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        log_samples=False,
        bootstrap_iters=0,
    )
    results = {}
    for task, values in output["results"].items():
        metrics = {
            key.split(",")[0]: float(value)
            for key, value in values.items()
            if "," in key and "_stderr" not in key and isinstance(value, int | float)
        }
        results[task] = {"metrics": metrics, "higher_is_better": dict(output["higher_is_better"].get(task, {}))}
    return results
