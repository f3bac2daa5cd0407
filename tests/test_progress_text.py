"""Progress lines and loss formatting survive what the worker sends for non-finite values."""

import pytest

from migration.common import fmt_loss
from migration.service.orchestrate import describe


@pytest.mark.parametrize("loss,shown", [(2.5, "2.5000"), (None, "nan"), ("inf", "inf"), ("-inf", "-inf")])
def test_a_step_line_shows_any_loss_the_worker_reports(loss, shown):
    line = describe("migrated", 10, {"event": "step", "index": 2, "loss": loss, "step_ms": 12.5})
    assert line == f"migrated: step 3 of 10, loss {shown}, 12.5 ms"
    assert fmt_loss(loss) == shown


def test_a_skipped_fp16_step_says_so():
    line = describe("migrated", 4, {"event": "step", "index": 0, "loss": 1.0, "step_ms": 1.0, "skipped": True})
    assert line.endswith("(skipped: non-finite gradients)")
