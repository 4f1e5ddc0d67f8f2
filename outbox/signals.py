"""Signals the outbox sends upward without importing the apps above it.

`message_ambiguous` fires inside the transaction that moved a message to `unknown`, so a
receiver (reconciliation) that writes a case commits or rolls back with the transition.
"""

import django.dispatch

# sender=OutboundMessage, message=<OutboundMessage>, facts=<dict>
message_ambiguous = django.dispatch.Signal()
# sender=OutboundMessage, message=<OutboundMessage>, dead_letter=<DeadLetter>
message_dead_lettered = django.dispatch.Signal()
# sender=Effect, effect=<Effect>, facts=<dict>: an effect's outcome is unknown and no
# lookup settled it; reconciliation opens a case (inside the sender's transaction).
effect_ambiguous = django.dispatch.Signal()
# sender=OutboundMessage, message=<OutboundMessage>, attempt_number=<int>: Telegram's success
# arrived after the sweeper had given the send up (unknown, or queued again by a resend
# decision); the message is sent now. Reconciliation closes its case as delivered
# (inside the sender's transaction).
message_delivered_late = django.dispatch.Signal()
