"""The calibration search both published checks use (`bench/published_check.py --fit`, `--tpu --fit`): every
point of a grid of efficiencies, the one with the least root-mean-square log error on the tuning entries."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

from migration.planning import steptime


def search(tune: Sequence[dict], predicted: Callable[[dict, steptime.Calibration], float],
           published: Callable[[dict], float], grid: Iterable[Sequence[float]], start: steptime.Calibration
           ) -> steptime.Calibration:
    """The grid's best (matmul, attention, memory, launch_s, link) for `tune`, collective_s kept from `start`."""
    best, best_cal = math.inf, start
    for mm, att, mem, launch, link in itertools.product(*grid):
        cal = steptime.Calibration(mm, att, mem, launch, link, start.collective_s)
        logs = [math.log(predicted(e, cal) / published(e)) for e in tune]
        rms = math.sqrt(sum(x * x for x in logs) / len(logs))
        if rms < best:
            best, best_cal = rms, cal
    print(f"best on {len(tune)} tuning entries (least root-mean-square log error): {best_cal} "
          f"(rms {math.exp(best) - 1:.1%})")
    return best_cal
