from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import IntegerField, QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property
from django.utils.html import format_html

from core.ids import int64_or_none
from core.logs import redact
from core.masking import can_view_payload, mask
from core.payloads import pretty_json
from outbox.models import ApiClient, Attempt, Circuit, Effect, ErrorClass


class ReadOnlyAdmin(admin.ModelAdmin):
    """A record the admin shows and never writes: no add, change or delete, for anyone."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class RedactedFieldsMixin:
    """Error texts and results may echo what a person wrote or who they are (a CRM's or a
    model's answer quoting the lead, Telegram's result): without payload access they are
    shown redacted. `redacted_text_fields` name texts (redacted by pattern: phones, e-mail
    addresses, quoted names), `redacted_json_fields` JSON (masked as payloads are); each is
    replaced by a read-only `<name>_redacted` for such users."""

    redacted_text_fields: tuple[str, ...] = ()
    redacted_json_fields: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.redacted_text_fields:
            setattr(cls, f"{name}_redacted", _display(name, lambda v: redact(v or "")))
        for name in cls.redacted_json_fields:
            setattr(cls, f"{name}_redacted", _display(name, _masked_json))

    def _redacted(self, request, names) -> list[str]:
        if can_view_payload(request.user):
            return list(names)
        hidden = {*self.redacted_text_fields, *self.redacted_json_fields}
        return [f"{name}_redacted" if name in hidden else name for name in names]

    def shown(self, request: HttpRequest, obj: Any, name: str) -> Any:
        """`obj.<name>` as this request's user sees it on the object's page (an export's cell)."""
        [field] = self._redacted(request, [name])
        return getattr(self, field)(obj) if field != name else getattr(obj, name)

    def get_fields(self, request, obj=None):
        return self._redacted(request, super().get_fields(request, obj))

    def get_readonly_fields(self, request, obj=None):
        return self._redacted(request, super().get_readonly_fields(request, obj))


class FixedChoicesFilter(admin.SimpleListFilter):
    """A list filter whose options are fixed (a model's choices, the Bot API methods, the
    registry's consumers), not a `SELECT DISTINCT` over a table of a million rows on every
    page load. Subclasses name the field and give `choices()`."""

    field_name = ""

    def choices_for(self, request) -> list[tuple[str, str]]:
        raise NotImplementedError

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return self.choices_for(request)

    def queryset(self, request, queryset: QuerySet) -> QuerySet | None:
        return queryset.filter(**{self.field_name: self.value()}) if self.value() else None


def fixed_filter(field_name: str, choices: Any, title: str | None = None) -> type[FixedChoicesFilter]:
    """A FixedChoicesFilter on `field_name`; `choices` is a list of pairs or a callable returning one."""

    def choices_for(self, request) -> list[tuple[str, str]]:
        return list(choices() if callable(choices) else choices)

    return type(
        f"{field_name.title().replace('_', '')}Filter",
        (FixedChoicesFilter,),
        {
            "title": title or field_name.replace("_", " "),
            "parameter_name": field_name,
            "field_name": field_name,
            "choices_for": choices_for,
        },
    )


def _methods() -> list[tuple[str, str]]:
    from outbox.methods import SUPPORTED_METHODS

    return [(m, m) for m in sorted(SUPPORTED_METHODS)]


def _consumers() -> list[tuple[str, str]]:
    from bots import registry

    return [(n, n) for n in sorted(registry.registered())]


def exact_search(
    queryset: QuerySet,
    term: str,
    text_fields: tuple[str, ...],
    int_fields: tuple[str, ...],
    per_bot_fields: tuple[str, ...] = (),
) -> QuerySet:
    """One search box, exact matches on indexed columns only: a trace id or a key as typed,
    a number as an integer id (never `UPPER(chat_id::text)`, which no index serves).
    `per_bot_fields` are unique per bot, indexed as (bot, field): the bots are named, so the
    planner walks that index once per bot instead of scanning the table."""
    from bots.models import Bot

    term = term.strip()
    number = int64_or_none(term)
    matches = queryset.none()
    for name in text_fields:
        matches |= queryset.filter(**{name: term})
    if per_bot_fields:
        bot_ids = list(Bot.objects.values_list("pk", flat=True))
        for name in per_bot_fields:
            value: str | int | None = term
            if isinstance(queryset.model._meta.get_field(name), IntegerField):
                value = number
            if value is not None:
                matches |= queryset.filter(**{"bot_id__in": bot_ids, name: value})
    if number is not None:
        for name in int_fields:
            matches |= queryset.filter(**{name: number})
    return matches


MethodFilter = fixed_filter("method", _methods)
LastErrorClassFilter = fixed_filter("last_error_class", ErrorClass.choices, "last error class")
ConsumerNameFilter = fixed_filter("consumer", _consumers)


class CappedCountPaginator(Paginator):
    """Counts at most `cap` rows (`COUNT(*)` over a `LIMIT` subquery): on a table of millions
    an exact count of a filter's matches costs a scan on every page. Past the cap the
    changelist says `cap` results and pages up to there; a narrower filter finds the rest."""

    cap = 10_000

    @cached_property
    def count(self) -> int:
        object_list = self.object_list
        if isinstance(object_list, QuerySet):
            return object_list[: self.cap].count()
        return min(len(object_list), self.cap)


class ExactSearchMixin:
    """Search on the big tables: `exact_text_fields`, `exact_int_fields` and
    `exact_per_bot_fields`, equality only; a capped count of the matches and no full count
    of the table under the result (`show_full_result_count`)."""

    exact_text_fields: tuple[str, ...] = ()
    exact_int_fields: tuple[str, ...] = ()
    exact_per_bot_fields: tuple[str, ...] = ()
    show_full_result_count = False
    paginator = CappedCountPaginator

    def get_search_results(self, request, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        if not search_term.strip():
            return queryset, False
        found = exact_search(
            queryset, search_term, self.exact_text_fields, self.exact_int_fields, self.exact_per_bot_fields
        )
        return found, False


def _masked_json(value: Any) -> str:
    return format_html("<pre class='dovecote-json'>{}</pre>", pretty_json(mask(value)))


def _display(name: str, redact_value: Any) -> Any:
    def show(self: Any, obj: Any) -> Any:
        return redact_value(getattr(obj, name))

    show.short_description = name.replace("_", " ")
    return show


class AttemptInline(RedactedFieldsMixin, admin.TabularInline):
    model = Attempt
    redacted_text_fields = ("description",)
    extra = 0
    can_delete = False
    fields = [
        "number",
        "started_at",
        "finished_at",
        "worker",
        "outcome",
        "http_status",
        "error_code",
        "description",
        "retry_after",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


# Registered by reconciliation/admin/other_apps.py, which extends it (payload masking by permission).
class OutboundMessageAdmin(ExactSearchMixin, RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    redacted_json_fields = ("result",)
    list_display = [
        "id",
        "bot",
        "chat_id",
        "method",
        "state",
        "attempts",
        "last_error_class",
        "next_attempt_at",
        "created_at",
    ]
    list_filter = ["state", "bot", MethodFilter, LastErrorClassFilter]
    # Chat id, idempotency key or trace id, exactly (ExactSearchMixin).
    search_fields = ["=chat_id", "=idempotency_key", "=trace_id"]
    exact_text_fields = ("trace_id",)
    exact_per_bot_fields = ("idempotency_key",)
    exact_int_fields = ("chat_id", "id")
    list_select_related = ["bot"]
    raw_id_fields = ["source_update"]
    readonly_fields = [
        "state",
        "attempts",
        "lease_owner",
        "lease_expires_at",
        "last_error",
        "last_error_class",
        "telegram_message_id",
        "result",
        "sent_at",
        "created_at",
        "updated_at",
        "rate_limited_count",
        "payload_purged_at",
        "cancel_reason",
    ]
    inlines = [AttemptInline]
    # No date_hierarchy: its DATE_TRUNC queries scan the whole table on every page.


@admin.register(Effect)
class EffectAdmin(RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    redacted_json_fields = ("result",)
    list_display = ["key", "state", "external_id", "attempts", "created_at", "done_at"]
    list_filter = ["state"]
    search_fields = ["key", "external_id", "trace_id"]
    readonly_fields = [f.name for f in Effect._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Circuit)
class CircuitAdmin(ReadOnlyAdmin):
    """Read-only: an operator opens or closes a circuit with Pause and Resume on the bot's
    page, which ask for a reason and write the audit log; a bare edit here would not."""

    list_display = ["scope", "state", "manual", "consecutive_failures", "opened_at", "next_probe_at"]
    list_filter = ["state", "manual"]
    readonly_fields = ["state", "consecutive_failures", "opened_at", "next_probe_at", "updated_at"]


@admin.register(ApiClient)
class ApiClientAdmin(admin.ModelAdmin):
    """Which bots each REST API client may use (`manage.py add_api_client` creates them)."""

    list_display = ["user", "payload_access", "created_at"]
    list_filter = ["payload_access"]
    search_fields = ["user__username"]
    filter_horizontal = ["bots"]
    raw_id_fields = ["user"]
