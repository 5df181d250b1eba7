"""lm-evaluation-harness scores a running tierserve through the API, as its users run it: the ``local-completions``
model on a multiple-choice task over a local JSONL file (``tests/data/lm_eval/tiny_mc.jsonl``, no download), with
its Hugging Face tokenizer and with the server's own (``tokenizer_backend=remote``: ``/tokenize``). Each item's
log-likelihoods equal those ``transformers`` computes in-process on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import require_service
from tests.engine_helpers import build_checkpoint
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parent / "data" / "lm_eval" / "tiny_mc.jsonl"
TASK = "tierserve_tiny_mc"
NAME = "tiny-eval"
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")
    overrides = {("model", "path"): str(checkpoint), ("model", "device"): "cpu", ("model", "dtype"): "float32",
                 ("model", "served_model_name"): NAME, ("logging", "level"): "warning"}  # fmt: skip
    loaded = load_settings(None, environ={}, overrides=overrides)
    with running_server(loaded.settings, plugins=loaded.plugins) as base:
        yield checkpoint, base


def in_process_loglikelihoods(checkpoint: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """``transformers``' float32 log-likelihood of each continuation after its context, the pair split into tokens
    as lm-eval splits it (trailing spaces of the context go to the continuation; the whole is encoded, then cut
    where the context's own encoding ends)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        start = len(tokenizer(context, add_special_tokens=False).input_ids)
        with torch.inference_mode():
            logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        out.append(sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole))))
    return out


def pairs_and_scores(samples: list[dict]) -> tuple[list[tuple[str, str]], list[float]]:
    """Every (context, continuation) lm-eval sent, and the log-likelihood it read back, in order."""
    pairs, scores = [], []
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        arguments = sample["arguments"]
        args = [(a["arg_0"], a["arg_1"]) for a in arguments.values()] if isinstance(arguments, dict) else arguments
        pairs += [(context, continuation) for context, continuation in args]
        scores += [float(response[0]) for response in sample["filtered_resps"]]
    return pairs, scores


@pytest.mark.parametrize("tokenizer_backend", ["huggingface", "remote"])
def test_lm_eval_scores_each_item_as_transformers_does(served, tmp_path, monkeypatch, tokenizer_backend):
    checkpoint, base = served
    for variable, value in {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(variable, value)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        require_service("lm-eval", "pip install -e '.[test]' installs lm-eval[api]")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=DATA))
    model_args = {"model": NAME, "base_url": f"{base}/v1/completions", "tokenizer_backend": tokenizer_backend,
                  "num_concurrent": 1, "max_retries": 1}  # fmt: skip
    if tokenizer_backend == "huggingface":
        model_args.update(tokenizer=str(checkpoint), batch_size=8)  # several prompts in one request
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    samples = results["samples"][TASK]
    assert len(samples) == sum(1 for line in DATA.read_text().splitlines() if line.strip())
    pairs, scores = pairs_and_scores(samples)
    assert len(pairs) == 4 * len(samples)
    expected = in_process_loglikelihoods(checkpoint, pairs)
    worst = max(abs(got - want) for got, want in zip(scores, expected))
    assert worst < 2e-4, f"largest difference from transformers: {worst}"
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
