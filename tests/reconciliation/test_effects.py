"""The effect ledger barrier: one key per effect, done effects skipped, unknown never repeated."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from bots.registry import ConsumerContext, PermanentError, TransientError
from outbox.effects import NOT_APPLIED, EffectAmbiguous, EffectFailed, EffectInProgress, effect, effect_run
from outbox.models import Effect, EffectState, OutboundMessage
from reconciliation.models import CaseStatus, ReconciliationCase
from tests.reconciliation.factories import stored_update


class FakeCrm:
    """Stands in for an external system: counts the calls that reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def post(self, handle) -> dict:
        self.calls.append(handle.key)
        return {"id": f"crm-{len(self.calls)}"}


def ctx_for(update, consumer: str = "crm") -> ConsumerContext:
    return ConsumerContext(update=update, consumer=consumer, trace_id=update.trace_id, attempt=1)


def test_a_done_effect_is_skipped_and_its_stored_result_returned(db: None) -> None:
    crm = FakeCrm()
    first = effect_run("eff:test:1", crm.post)
    again = effect_run("eff:test:1", crm.post)

    assert first == again == {"id": "crm-1"}
    assert crm.calls == ["eff:test:1"]
    row = Effect.objects.get(key="eff:test:1")
    assert row.state == EffectState.DONE
    assert row.done_at is not None
    assert row.attempts == 1


def test_the_context_manager_form_keeps_the_external_id(db: None) -> None:
    with effect("eff:test:cm") as e:
        assert not e.done
        e.record(result={"ok": True}, external_id="ext-9")
    with effect("eff:test:cm") as e:
        assert e.done
        assert e.result == {"ok": True}
    assert Effect.objects.get(key="eff:test:cm").external_id == "ext-9"


def test_a_live_lease_stops_a_second_runner(db: None) -> None:
    Effect.objects.create(
        key="eff:test:live",
        state=EffectState.STARTED,
        lease_owner="bob:1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
        attempts=1,
    )
    crm = FakeCrm()
    with pytest.raises(EffectInProgress):
        effect_run("eff:test:live", crm.post)
    assert crm.calls == []


def test_an_effect_known_not_to_have_applied_is_failed_and_may_run_again(db: None) -> None:
    def refused(handle) -> None:
        raise EffectFailed("CRM answered 503: nothing was stored")

    with pytest.raises(EffectFailed):
        effect_run("eff:test:refused", refused)
    assert Effect.objects.get(key="eff:test:refused").state == EffectState.FAILED

    crm = FakeCrm()
    assert effect_run("eff:test:refused", crm.post) == {"id": "crm-1"}
    row = Effect.objects.get(key="eff:test:refused")
    assert row.state == EffectState.DONE
    assert row.attempts == 2


def test_an_unknown_effect_is_not_repeated_and_opens_one_case(db: None) -> None:
    def timed_out(handle) -> None:
        raise TimeoutError("read timed out after the request was sent")

    with pytest.raises(TimeoutError):
        effect_run("eff:test:unknown", timed_out)
    assert Effect.objects.get(key="eff:test:unknown").state == EffectState.UNKNOWN

    crm = FakeCrm()
    for _ in range(3):
        with pytest.raises(EffectAmbiguous):
            effect_run("eff:test:unknown", crm.post)
    assert crm.calls == []
    case = ReconciliationCase.objects.get(effect__key="eff:test:unknown")
    assert case.status == CaseStatus.OPEN
    assert case.idempotency_key == "eff:test:unknown"
    assert case.known_facts["kind"] == "effect"


def test_an_abandoned_effect_whose_lease_ran_out_counts_as_unknown(db: None) -> None:
    Effect.objects.create(
        key="eff:test:abandoned",
        state=EffectState.STARTED,
        lease_owner="dead:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        attempts=1,
    )
    crm = FakeCrm()
    with pytest.raises(EffectAmbiguous):
        effect_run("eff:test:abandoned", crm.post)
    assert crm.calls == []
    assert Effect.objects.get(key="eff:test:abandoned").state == EffectState.UNKNOWN


def test_a_read_only_lookup_settles_an_unknown_effect_without_repeating_it(db: None) -> None:
    Effect.objects.create(key="eff:test:lookup", state=EffectState.UNKNOWN, attempts=1)
    crm = FakeCrm()
    found = effect_run("eff:test:lookup", crm.post, reconcile=lambda key: {"id": "crm-77", "key": key})
    assert found == {"id": "crm-77", "key": "eff:test:lookup"}
    assert crm.calls == []
    row = Effect.objects.get(key="eff:test:lookup")
    assert (row.state, row.external_id) == (EffectState.DONE, "crm-77")
    assert not ReconciliationCase.objects.filter(effect=row).exists()


def test_a_lookup_that_finds_nothing_lets_the_effect_run_once_more(db: None) -> None:
    Effect.objects.create(key="eff:test:absent", state=EffectState.UNKNOWN, attempts=1)
    crm = FakeCrm()
    assert effect_run("eff:test:absent", crm.post, reconcile=lambda key: NOT_APPLIED) == {"id": "crm-1"}
    assert crm.calls == ["eff:test:absent"]


def test_a_sent_message_does_not_block_the_crm_effect_of_the_same_update(bot, db: None) -> None:
    update = stored_update(bot)
    ctx = ctx_for(update, consumer="auto_reply")
    crm = FakeCrm()

    ctx.reply("Thanks, noted")
    result = ctx.effect("crm_post", crm.post)
    analytics = ctx.effect("analytics", crm.post)

    assert result == {"id": "crm-1"}
    assert analytics == {"id": "crm-2"}
    assert OutboundMessage.objects.filter(source_update=update).count() == 1
    assert Effect.objects.filter(key__startswith=f"eff:{bot.pk}:{update.update_id}:auto_reply:").count() == 2


def test_a_new_command_of_the_user_is_not_swallowed_by_the_previous_ones_key(bot, db: None) -> None:
    crm = FakeCrm()
    first, second = stored_update(bot, text="/buy"), stored_update(bot, text="/buy")

    ctx_for(first).effect("order", crm.post)
    ctx_for(first).effect("order", crm.post)  # a retry of the same run: skipped
    ctx_for(second).effect("order", crm.post)  # the user meant it again: a second order

    assert len(crm.calls) == 2
    assert crm.calls[0] != crm.calls[1]


def test_the_consumer_context_turns_barrier_refusals_into_consumer_errors(bot, db: None) -> None:
    update = stored_update(bot)
    ctx = ctx_for(update)
    Effect.objects.create(
        key=ctx.effect_key("order"),
        state=EffectState.STARTED,
        lease_owner="bob:1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    with pytest.raises(TransientError):
        ctx.effect("order", FakeCrm().post)
    Effect.objects.filter(key=ctx.effect_key("order")).update(state=EffectState.UNKNOWN)
    with pytest.raises(PermanentError):
        ctx.effect("order", FakeCrm().post)


def test_a_consumer_error_inside_the_effect_means_not_applied(bot, db: None) -> None:
    ctx = ctx_for(stored_update(bot))

    def refused(handle) -> None:
        raise TransientError("CRM 503")

    with pytest.raises(TransientError):
        ctx.effect("order", refused)
    assert Effect.objects.get(key=ctx.effect_key("order")).state == EffectState.FAILED
