"""Out of device memory in sampling or in training: the run stops with one message that names the knobs bounding what
it holds at once, its last checkpoint kept, and --resume auto continues it. On CPU the error is raised as
torch.OutOfMemoryError (what CUDA raises) where the real one would come: generate() and the train step."""

import pytest
import torch

import gigpo
import harness
import samplers
import training

KNOBS = ("--sample-batch-size", "--micro-batch-tokens", "--kv-cache-mb", "--vllm-gpu-memory-utilization")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["sampling", "training"])
def test_out_of_memory_stops_the_run_with_the_knobs_and_it_resumes(where, tmp_path, monkeypatch, capfd):
    owner, name = (samplers.GenerateSampler, "_generate") if where == "sampling" else (training, "train_step")
    real = getattr(owner, name)

    def out_of_memory_after_the_first_checkpoint(*args, **kwargs):
        if list(tmp_path.glob("*/checkpoints/update_000001")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, out_of_memory_after_the_first_checkpoint)
    argv = ["smoke", "--output-dir", str(tmp_path), "--save-every", "1"]
    with pytest.raises(SystemExit) as stopped:
        harness.cli(gigpo.Args, gigpo.main, gigpo.PRESETS, argv)
    assert stopped.value.code == 1
    (run,) = tmp_path.iterdir()
    err = capfd.readouterr().err
    assert err.count("error: ") == 1  # one message (after the progress bars' carriage returns)
    message = err[err.index("error: ") :].splitlines()[0]
    assert "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in message
    assert f"the last checkpoint, {run / 'checkpoints' / 'update_000001'}, is kept" in message
    assert all(knob in message for knob in KNOBS) and "--resume auto" in message
    assert [c.name for c in (run / "checkpoints").iterdir()] == ["update_000001"]

    monkeypatch.undo()
    assert harness.cli(gigpo.Args, gigpo.main, gigpo.PRESETS, [*argv, "--resume", "auto"]) == run
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [f"update_{u:06d}" for u in (1, 2, 3)]
