"""Run by tests/test_trainer.py, under ``accelerate launch`` (4 processes) or plain python (1).

python tests/trainer_worker.py OUT_DIR SCENARIO RUN_DIR [OUT_DIR SCENARIO RUN_DIR ...]

Several scenarios run one after the other in the same processes (a launch costs each process its
imports of torch and transformers), each with a trainer of its own.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from decentadam.integrations.trainer import DecentralizedArguments, DecentralizedTrainer

VOCAB = 48
LENGTH = 12


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences with a learnable pattern: each token is the previous one plus a small step."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=generator)
        steps = torch.randint(1, 3, (count, LENGTH), generator=generator).cumsum(1)
        self.ids = (start + steps) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class Recorder(TrainerCallback):  # type: ignore[misc]
    """Checks the weights used by evaluation (consensus) and after it (local)."""

    def __init__(self) -> None:
        self.eval_weights: list[torch.Tensor] = []
        self.predict_weights: list[torch.Tensor] = []

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.eval_weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.predict_weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())


class RecordingTrainer(DecentralizedTrainer):
    """Keeps the inputs and this rank's gradient of the first training step."""

    first_inputs: dict[str, torch.Tensor] | None = None
    first_grad: torch.Tensor | None = None
    first_rng: torch.Tensor | None = None
    first_num_items: Any = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        rng = torch.get_rng_state()  # the dropout masks of this step, for the reference
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        if self.first_grad is None:
            self.first_rng = rng
            self.first_num_items = num_items_in_batch
            self.first_inputs = {k: v.detach().clone() for k, v in inputs.items()}
            self.first_grad = torch.cat(
                [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
            )
        return loss


def arguments(run_dir: Path, max_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(run_dir),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        adam_beta2=0.999,
        weight_decay=0.01,
        max_steps=max_steps,
        logging_steps=1,
        save_steps=3,
        save_strategy="steps",
        eval_strategy="no",
        max_grad_norm=0.0,  # no clipping: the recorded gradient is the raw one
        report_to=[],
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def train(out: dict[str, Any], run_dir: Path, resume: str | bool | None, topology: str = "aer") -> None:
    model = make_model()
    initial = copy.deepcopy(model.state_dict())
    recorder = Recorder()
    trainer = RecordingTrainer(
        model=model,
        args=arguments(run_dir, max_steps=6),
        train_dataset=Sequences(256, seed=1),
        eval_dataset=Sequences(32, seed=2),
        callbacks=[recorder],
        decentralized=DecentralizedArguments(  # every rank a worker of the graph, float32 parameters
            topology=topology,
            exchange="parameters",
            average_every=0,
            intra_node="gossip",
            second_moment="local",
            accum_steps=2,
            local_world_size=2,
        ),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(resume_from_checkpoint=resume)
        except ValueError as error:  # a refused resume: every rank raises the same
            out["error"] = str(error)
            return
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    metrics = trainer.evaluate()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    trainer.predict(Sequences(8, seed=3))
    after_predict = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    out.update(
        history=trainer.state.log_history,
        wrapped=type(trainer.model_wrapped).__name__,
        average_tokens=trainer.args.average_tokens_across_devices,
        eval_loss=metrics["eval_loss"],
        eval_weights=recorder.eval_weights[-1],
        local=local,
        after_eval=after,
        predict_weights=recorder.predict_weights[-1],
        after_predict=after_predict,
        warnings=[
            str(w.message) for w in caught if "decentadam" in str(w.message) or "ranks" in str(w.message)
        ],
        world_size=trainer.args.world_size,
    )
    if trainer.first_grad is not None and resume is None:
        # The same step in a single process: this rank's batch through the initial model.
        reference = make_model()
        reference.load_state_dict(initial)
        inputs = trainer.first_inputs
        assert inputs is not None
        assert trainer.first_rng is not None
        torch.set_rng_state(trainer.first_rng)
        # Trainer normalises by the label count it passes; in one process that is this batch's own.
        reference(**inputs, num_items_in_batch=trainer.first_num_items).loss.backward()
        out["first_grad"] = trainer.first_grad
        out["num_items"] = int(trainer.first_num_items)
        out["local_labels"] = int(inputs["labels"].numel())
        out["reference_grad"] = torch.cat(
            [p.grad.reshape(-1) for p in reference.parameters() if p.grad is not None]
        )


def main() -> None:
    argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    for out_dir, scenario, run_dir in zip(argv[0::3], argv[1::3], argv[2::3], strict=True):
        out: dict[str, Any] = {}
        topology = "aer"
        if scenario.startswith("topology:"):  # "topology:NAME=CHECKPOINT": resume it with another topology
            topology, _, scenario = scenario.removeprefix("topology:").partition("=")
        resume: str | bool | None = {"fresh": None, "resume-last": True}.get(scenario, scenario)
        train(out, Path(run_dir), resume, topology)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
