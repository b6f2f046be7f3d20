import pytest

from schedulers import AgingPolicy, DeadlinePolicy, InvalidPriorityClass, PriorityClass, ShedReason, parse_priority


def test_parse_priority_accepts_names_case_insensitively():
    assert parse_priority("interactive") is PriorityClass.INTERACTIVE
    assert parse_priority(" Batch ") is PriorityClass.BATCH
    assert parse_priority(PriorityClass.BATCH) is PriorityClass.BATCH


def test_parse_priority_defaults_when_missing():
    assert parse_priority(None) is PriorityClass.INTERACTIVE
    assert parse_priority("", default=PriorityClass.BATCH) is PriorityClass.BATCH


@pytest.mark.parametrize("bad", ["urgent", "interactive2", 3])
def test_parse_priority_rejects_unknown(bad):
    with pytest.raises(InvalidPriorityClass):
        parse_priority(bad)


def test_interactive_outranks_batch():
    assert PriorityClass.INTERACTIVE.rank < PriorityClass.BATCH.rank


def test_batch_ages_into_interactive():
    aging = AgingPolicy(batch_aging_s=10)
    assert aging.effective_priority(PriorityClass.BATCH, 100.0, 109.9) is PriorityClass.BATCH
    assert aging.effective_priority(PriorityClass.BATCH, 100.0, 110.0) is PriorityClass.INTERACTIVE
    assert aging.effective_priority(PriorityClass.INTERACTIVE, 100.0, 100.0) is PriorityClass.INTERACTIVE


def test_deadline_reasons():
    policy = DeadlinePolicy()
    assert policy.shed_reason(None, 1e9) is None
    assert policy.shed_reason(100.0, 100.0) is ShedReason.DEADLINE_EXPIRED
    assert policy.shed_reason(100.0, 101.0) is ShedReason.DEADLINE_EXPIRED
    assert policy.shed_reason(100.0, 99.9) is None
