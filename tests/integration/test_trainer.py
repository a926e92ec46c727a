"""fxmem under Hugging Face's Trainer: the same loss curve as eager training.

``TrainingArguments(torch_compile_backend="fxmem")`` is rejected by accelerate's DynamoBackend enum,
and it could not pass fxmem's options anyway. The supported path: compile the model in place with
``model.compile(backend="fxmem", options=...)`` before handing it to the Trainer. The model stays
a GPT2LMHeadModel, so the Trainer's column filtering (remove_unused_columns) and saving work as usual.
"""
import warnings

import pytest
import torch

import fxmem


class TokenBatches(torch.utils.data.Dataset):
    def __init__(self, n=8, seq=16, vocab=128):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, options=None):
    """Train a tiny GPT-2 (from a config, no download) for 6 steps; the logged losses, the final
    parameters and the model."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    # No dropout: a compiled graph draws other random numbers than eager, and the curves must match.
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if options is not None:
        model.compile(backend="fxmem", options=options)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, per_device_train_batch_size=4, max_steps=6,
                             logging_steps=1, learning_rate=3e-3, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TokenBatches())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", RuntimeWarning)  # an fxmem stage falling back fails the test
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, model


@pytest.mark.slow
def test_trainer_with_fxmem_model_gives_eager_loss_curve(tmp_path):
    torch._dynamo.reset()
    eager_losses, eager_params, _ = _train(tmp_path / "eager")
    # The planner within the Trainer, compared with eager at 1e-5 after six optimizer steps: no
    # lowering (the fused kernels of the default sum in another order; tests/test_lowering.py
    # checks them against the unfused graph).
    losses, params, model = _train(tmp_path / "fxmem", {"inner": "eager", "level": 1, "lowering": False})

    records = [g for c in fxmem.compilations(model) for g in c.graphs]
    assert records and sum(r.plan.saved_bytes for r in records) > 0, "fxmem planned no training graph"
    assert len(eager_losses) == 6 and eager_losses[-1] < eager_losses[0], eager_losses  # it does train
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for name, p in eager_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name} after training: {m}")
    assert [f.name for f in tmp_path.rglob("*") if f.is_file()] == []  # nothing written, even in tmp_path
