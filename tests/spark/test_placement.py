"""The policy of task placement by cache (spark_glue.placement.Placement.assign), without a Spark session: stateful workers stay where their state is cached, a stage's workers spread over the warm Spark executors, a lost Spark executor's workers go to the warm ones with the fewest, and a Spark executor not yet warm gets none."""

from __future__ import annotations

from collections import Counter

import pytest

from spark_glue.placement import Placement

pytestmark = pytest.mark.spark  # no session: spark_glue's policy alone (tests/spark's rule: every test is marked)


def _placement(last: dict[tuple[int, int], str], warm: set[str]) -> Placement:
    pl = Placement()
    for (k, w), e in last.items():
        pl.ran_on(k, w, ("h", e), True)
    pl.warm = set(warm)
    return pl


def test_no_warm_executor_no_preference() -> None:
    assert Placement().assign([False, True], 3, ["0", "1"]) == {0: [None] * 3, 1: [None] * 3}


def test_workers_stay_where_their_state_is() -> None:
    last = {(1, 0): "1", (1, 1): "0", (1, 2): "1", (1, 3): "0"}
    pl = _placement(last, {"0", "1"})
    got = pl.assign([False, True], 4, ["0", "1"])
    assert got[1] == ["1", "0", "1", "0"]
    assert got[0] == got[1]  # a stateless stage's task w goes where worker w's state is


def test_a_crowded_executor_gives_workers_to_the_others() -> None:
    pl = _placement({(0, w): "0" for w in range(4)}, {"0", "1"})
    got = pl.assign([True], 4, ["0", "1"])[0]
    assert Counter(got) == Counter({"0": 2, "1": 2})
    assert got[:2] == ["0", "0"]  # the first ones under the share stay
    for w, e in enumerate(got):
        pl.ran_on(0, w, ("h", e), True)
    assert pl.stats["moved"] == 2 and pl.last == {(0, w): e for w, e in enumerate(got)}


def test_a_lost_executors_workers_go_to_the_warm_ones_and_a_cold_one_gets_none() -> None:
    last = {(0, 0): "0", (0, 1): "1", (0, 2): "0", (0, 3): "1", (0, 4): "2", (0, 5): "2"}
    pl = _placement(last, {"0", "1", "2"})
    # "2" is lost, "3" (its replacement) is alive but not warm yet
    got = pl.assign([True], 6, ["0", "1", "3"])[0]
    assert got[:4] == ["0", "1", "0", "1"]
    assert Counter(got) == Counter({"0": 3, "1": 3})
    pl.warm.add("3")  # its warm-up task reported: it takes a share, the others keep theirs
    got = pl.assign([True], 6, ["0", "1", "3"])[0]
    assert Counter(got) == Counter({"0": 2, "1": 2, "3": 2})


def test_where_tasks_ran_is_counted_against_where_they_were_asked() -> None:
    pl = _placement({(0, 0): "0"}, {"0"})
    pl.asked = {(0, 0): "0", (0, 1): "0"}
    pl.ran_on(0, 0, ("h", "0"), True)
    pl.ran_on(0, 1, ("h", "1"), True)
    assert pl.stats["asked"] == 2 and pl.stats["ran_as_asked"] == 1
    assert pl.last == {(0, 0): "0", (0, 1): "1"} and pl.location("1") == "executor_h_1"
