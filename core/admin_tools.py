"""The admin's shared pieces, for every app's admin: exact search on the big tables with a
capped count, list filters with fixed choices, fields shown redacted to users without payload
access, and read-only admins."""

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
    planner walks that index once per bot instead of scanning the table. The bots are those
    of the model's `bot` foreign key."""
    term = term.strip()
    number = int64_or_none(term)
    matches = queryset.none()
    for name in text_fields:
        matches |= queryset.filter(**{name: term})
    if per_bot_fields:
        bots = queryset.model._meta.get_field("bot").related_model
        bot_ids = list(bots.objects.values_list("pk", flat=True))
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
    @admin.display(description=name.replace("_", " "))
    def show(self: Any, obj: Any) -> Any:
        return redact_value(getattr(obj, name))

    return show
