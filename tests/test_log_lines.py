"""What a run's log says, read from a real run's stdout written to a file (as a cluster job's
log is): the final evaluation and the decode of a folder with their durations, an ETA that
counts the final evaluation, each epoch's own seconds, the target with the data set it was set
for, no blank lines from progress bars, and the epoch a short run is in."""
import json
import os
import re
import subprocess
import sys


def train_to_file(tmp_path, *args, env=None):
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "speedrun", "train", *map(str, args)], stdout=f,
                              stderr=subprocess.STDOUT, timeout=600, env={**os.environ, **(env or {})})
    text = log.read_text()
    assert proc.returncode == 0, text
    return text


def test_the_log_of_a_run_says_what_it_is_doing(tmp_path, fashion_small):
    out = tmp_path / "r"
    text = train_to_file(tmp_path, "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz",
                         "--set", "model.widths=[8,8,8]", "--set", "data.batch_size=128", "--set",
                         "train.epochs=1.5", "--set", "eval.tta=flip", "--log-every", "1", "--out", out)
    # step lines: the partial last epoch shows how far it has come; the ETA counts the final evaluation
    steps = re.findall(r"fashion-mnist step (\d+)/12 epoch (\S+) [\d,]+ img/s ETA \S+ \(with the final "
                       r"evaluation, estimated at \d+s\)", text)
    assert [s[0] for s in steps] == [str(i) for i in range(1, 12)]
    assert [s[1] for s in steps[8:]] == ["1.12/1.5", "1.25/1.5", "1.38/1.5"]
    # the final evaluation: a line as it starts and one with its duration, after the last step line
    start = text.index("fashion-mnist final evaluation: 256 test images, flip TTA\n")
    done = re.search(r"fashion-mnist final evaluation done in (\d+\.\d) s\n", text)
    assert text.index("step 11/12") < start < done.start()
    # each epoch's own seconds and the running total, in the log and in metrics.jsonl
    epochs = re.findall(r"fashion-mnist epoch (\S+) done: .* \((\d+\.\d) s, (\d+\.\d) s in all\)", text)
    assert [e[0] for e in epochs] == ["1/1.5", "1.5/1.5"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["seconds"] == metrics[0]["seconds_total"] > 0
    assert 0 < metrics[1]["seconds"] < metrics[1]["seconds_total"]
    summary = json.loads((out / "summary.json").read_text())
    assert abs(metrics[1]["seconds_total"] - summary["train_seconds"]) < 1e-6
    assert abs(metrics[1]["seconds_total"] - metrics[0]["seconds_total"] - metrics[1]["seconds"]
               - summary["final_eval_seconds"]) < 0.05           # the last epoch's own seconds leave it out
    # fashion-mnist's target is for Fashion-MNIST, not for this .npz file
    assert re.search(r"target\s+│\s+none set for fashion\.npz \(the recipe's is for fashion-mnist\)", text)
    assert summary["target"] is None and summary["target_set_for"] == "fashion-mnist"
    assert summary["target_reached"] is None


def test_a_run_shorter_than_an_epoch_shows_the_epoch_it_is_in(tmp_path, fashion_small):
    text = train_to_file(tmp_path, "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz",
                         "--set", "model.widths=[8,8,8]", "--set", "data.batch_size=128", "--set",
                         "train.epochs=0.5", "--set", "eval.tta=none", "--log-every", "1", "--out", tmp_path / "r")
    assert re.findall(r"fashion-mnist step \d/4 epoch (\S+) ", text) == ["0.12/0.5", "0.25/0.5", "0.38/0.5"]
    assert "fashion-mnist epoch 0.5/0.5 done" in text


def test_decoding_a_folder_is_logged_with_its_count_and_duration_and_no_blank_lines(tmp_path, jpeg32):
    text = train_to_file(tmp_path, "folder", "--data", jpeg32, "--set", "data.cache=on", "--set",
                         "model.widths=[8,16,16]", "--set", "data.batch_size=256", "--set", "train.epochs=0.5",
                         "--set", "eval.tta=none", "--set", "data.auto_choices=false", "--set", "data.image_size=32",
                         "--out", tmp_path / "r", env={"SPEEDRUN_CACHE": str(tmp_path / "cache")})
    assert re.search(r"speedrun: decoding 1,024 images once at 32 px into \S+\n", text)
    assert re.search(r"speedrun: decoded 1,024 images in \d+\.\d s \([\d,]+ images/s\)\n", text)
    before_table = text.split("┏")[0]
    assert "\n\n" not in before_table and not before_table.startswith("\n")    # no lines left by progress bars
    assert re.search(r"target\s+│\s+90\.00% \(folder\), (not )?reached", text)
