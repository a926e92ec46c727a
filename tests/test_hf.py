"""fxmem.hf: the Trainer compiles with fxmem through a callback and logs what fxmem did at step 1."""

import pytest
import torch


@pytest.mark.slow  # a Trainer, three steps, eager graphs: about 15 s
def test_trainer_callback_compiles_and_logs_the_summary_at_the_first_step(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import fxmem.hf

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 128, (8, 16))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    logged = []
    callback = fxmem.hf.FxmemCallback({"level": 1, "inner": "eager"}, log=logged.append)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert len(logged) == 1  # once, after the first step
    lines = logged[0].splitlines()
    assert lines[0].startswith("fxmem memory plan: graph 0, level 1") and lines[1].startswith("step peak (predicted)")
    assert "transformer.h." in lines[4]
    rep = fxmem.hf.report(trainer)
    assert [g.level for g in rep.graphs] == [1]
    assert fxmem.hf.summarize(rep) == logged[0]
