"""Thin Celery wrappers: take an id, call one service, own only the rescheduling.

The retry policy is not Celery's autoretry: the row's next_attempt_at is the one source of
truth for when a message is due (so the sweeper can redispatch a retry whose broker
message was lost), and the task only re-publishes itself for that moment.
"""

from celery import shared_task

from outbox.dispatch import dispatch
from outbox.sending import batch, probe, single


@shared_task(name="outbox.send_outbound_message", ignore_result=True)
def send_outbound_message(message_id: int, slot_reserved: bool = False, bulk: bool = False) -> str:
    result = single.outbound_message_send(message_id, slot_reserved=slot_reserved)
    if result.countdown is not None:
        # Short waits ride the broker; long ones stay in the row for the sweeper.
        dispatch(message_id, countdown=result.countdown, slot_reserved=result.slot_reserved, bulk=bulk)
    return result.status


@shared_task(name="outbox.drain_bot", ignore_result=True)
def drain_bot(bot_id: int, extra: bool = False) -> str:
    return str(batch.outbound_messages_drain(bot_id, extra=extra))


@shared_task(name="outbox.drain_broadcasts", ignore_result=True)
def drain_broadcasts(bot_id: int, timer: bool = False) -> str:
    return str(batch.outbound_broadcasts_drain(bot_id, timer=timer))


@shared_task(name="outbox.probe_bot", ignore_result=True)
def probe_bot(bot_id: int) -> str:
    return probe.bot_circuit_probe(bot_id)
