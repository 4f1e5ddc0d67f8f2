"""The operators' custom permissions (reconciliation.models) that the admin's buttons check."""

RETRY_PERMISSION = "reconciliation.retry_deadletter"
RESOLVE_PERMISSION = "reconciliation.resolve_deadletter"
DECIDE_PERMISSION = "reconciliation.decide_case"
PAUSE_PERMISSION = "reconciliation.pause_circuit"
CANCEL_PERMISSION = "reconciliation.cancel_message"
