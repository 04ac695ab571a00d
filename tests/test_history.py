"""metrics.csv (train/monitor/history.py): one row per epoch, an epoch replayed after a restart replaces its row."""

import csv

import pytest

from raymcn.train.monitor.history import EpochTable


def test_rows_per_epoch_with_every_metric_and_a_replayed_epoch_replaced(tmp_path):
    EpochTable(str(tmp_path)).record({"epoch": 1.0, "total_loss": 5.0, "text_to_video_R@10": 10.0})
    EpochTable(str(tmp_path)).record({"epoch": 2.0, "total_loss": 4.0, "text_to_video_R@10": 20.0, "time_eval_s": 1.5})
    EpochTable(str(tmp_path)).record({"epoch": 2.0, "total_loss": 3.5, "text_to_video_R@10": 21.0, "time_eval_s": 1.4})
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["epoch"]) for r in rows] == [1.0, 2.0]
    assert float(rows[1]["total_loss"]) == 3.5 and float(rows[1]["time_eval_s"]) == 1.4
    assert rows[0]["time_eval_s"] == ""  # a metric an epoch did not report stays empty
    assert list(rows[0])[0] == "epoch"


def test_a_row_whose_write_failed_is_written_with_the_next_one(tmp_path, monkeypatch):
    """Storage read-only for a while: epoch 2's write fails, epoch 3's carries it (chaos found the
    row lost when each write re-read the file)."""
    from raymcn import storage

    table = EpochTable(str(tmp_path))
    table.record({"epoch": 1.0, "total_loss": 5.0})
    real = storage.write_text

    def read_only(path, text):
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(storage, "write_text", read_only)
    with pytest.raises(PermissionError):
        table.record({"epoch": 2.0, "total_loss": 4.0})
    monkeypatch.setattr(storage, "write_text", real)
    table.record({"epoch": 3.0, "total_loss": 3.0})
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(r["epoch"], r["total_loss"]) for r in rows] == [("1.0", "5.0"), ("2.0", "4.0"), ("3.0", "3.0")]
    assert EpochTable(str(tmp_path)).rows.keys() == {1.0, 2.0, 3.0}  # a resumed run starts from the file
