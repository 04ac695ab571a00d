"""metrics.csv (train/monitor/history.py): one row per epoch, an epoch replayed after a restart replaces its row."""

import csv

from raymcn.train.monitor.history import record_epoch


def test_rows_per_epoch_with_every_metric_and_a_replayed_epoch_replaced(tmp_path):
    record_epoch(str(tmp_path), {"epoch": 1.0, "total_loss": 5.0, "text_to_video_R@10": 10.0})
    record_epoch(str(tmp_path), {"epoch": 2.0, "total_loss": 4.0, "text_to_video_R@10": 20.0, "time_eval_s": 1.5})
    record_epoch(str(tmp_path), {"epoch": 2.0, "total_loss": 3.5, "text_to_video_R@10": 21.0, "time_eval_s": 1.4})
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["epoch"]) for r in rows] == [1.0, 2.0]
    assert float(rows[1]["total_loss"]) == 3.5 and float(rows[1]["time_eval_s"]) == 1.4
    assert rows[0]["time_eval_s"] == ""  # a metric an epoch did not report stays empty
    assert list(rows[0])[0] == "epoch"
