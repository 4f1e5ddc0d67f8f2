"""The dead-letter changelist's filters beyond the model's own fields."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from bots.admin import ConsumerNameFilter
from core.ids import int64_or_none


class AgeBucketFilter(admin.SimpleListFilter):
    title = "age"
    parameter_name = "age"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("1h", "under 1 hour"), ("today", "today"), ("week", "this week"), ("older", "older")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        now = timezone.now()
        start_of_day = timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)
        bounds = {
            "1h": (now - timedelta(hours=1), None),
            "today": (start_of_day, None),
            "week": (now - timedelta(days=7), None),
            "older": (None, now - timedelta(days=7)),
        }
        if self.value() not in bounds:
            return None
        after, before = bounds[self.value()]
        if after is not None:
            queryset = queryset.filter(created_at__gte=after)
        if before is not None:
            queryset = queryset.filter(created_at__lt=before)
        return queryset


# The registry's consumer names, not a SELECT DISTINCT over the dead letters.
ConsumerFilter = ConsumerNameFilter


class KindFilter(admin.SimpleListFilter):
    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("message", "outbox message"), ("run", "consumer run")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        if self.value() == "message":
            return queryset.filter(message__isnull=False)
        if self.value() == "run":
            return queryset.filter(consumer_run__isnull=False)
        return None


class OwnerFilter(admin.SimpleListFilter):
    """The operators (active staff) and "nobody": read from the users table, not a SELECT
    DISTINCT over the dead letters, and never API clients (users too, but not staff)."""

    title = "owner"
    parameter_name = "owner"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        from django.contrib.auth import get_user_model

        staff = get_user_model().objects.filter(is_staff=True, is_active=True).order_by("username")
        return [("none", "nobody"), *((str(pk), name) for pk, name in staff.values_list("pk", "username"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        if self.value() == "none":
            return queryset.filter(owner__isnull=True)
        owner = int64_or_none(self.value() or "")
        return None if owner is None else queryset.filter(owner_id=owner)
