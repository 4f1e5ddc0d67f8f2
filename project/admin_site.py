"""The admin site: Django's, with the input of every admin page checked before the page reads
it, for the project's model admins and the installed apps' alike.

The cases where Django's admin raises on bad input (a 500) are answered here instead: a NUL
character in a parameter or URL (400), an action's selected id that is not an id (400), a date
drill-down past 9999 (`?e=1`), "view on site" of a model without a page (404).
`INSTALLED_APPS` names `AdminConfig` in place of `django.contrib.admin`, so `admin.site` is
this site. The cases in detail: docs/DESIGN.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache, wraps
from typing import Any

from django.contrib import admin
from django.contrib.admin.apps import AdminConfig as DjangoAdminConfig
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import BadRequest, ValidationError
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, URLResolver, path

from core.ids import int64_or_none


def _holds_nul(request: HttpRequest, kwargs: dict[str, Any]) -> bool:
    texts = [value for value in kwargs.values() if isinstance(value, str)]
    for params in (request.GET, request.POST):
        for key, values in params.lists():
            texts += [key, *values]
    return any("\x00" in text for text in texts)


def _refusing_nul(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if _holds_nul(request, kwargs):
            raise BadRequest("a parameter holds a NUL character, which no text here can hold")
        return view(request, *args, **kwargs)

    return checked


class _DateRangeChecks:
    def get_filters(self, request: HttpRequest) -> Any:
        try:
            return super().get_filters(request)
        except (ValueError, OverflowError) as exc:
            # Django checks that a drill-down's first day exists, not the day after its last.
            raise IncorrectLookupParameters(exc) from exc


@cache
def _date_range_checked(changelist: type[ChangeList]) -> type[ChangeList]:
    return type(changelist.__name__, (_DateRangeChecks, changelist), {})


class CheckedInputAdmin:
    """Mixed into every model admin the site registers."""

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _date_range_checked(super().get_changelist(request, **kwargs))

    def response_action(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        pk = self.model._meta.pk
        try:
            for value in request.POST.getlist(ACTION_CHECKBOX_NAME):
                pk.to_python(value)
        except ValidationError as exc:
            raise BadRequest("a selected row's id is not an id of this table") from exc
        return super().response_action(request, queryset)


def _view_on_site(request: HttpRequest, content_type_id: str, object_id: str) -> HttpResponse:
    """Django's shortcut, for a model that has a page on the site (get_absolute_url)."""
    # Imported here: this module is loaded with the app registry, before models can be.
    from django.contrib.contenttypes import views as contenttype_views
    from django.contrib.contenttypes.models import ContentType

    model = None
    pk = int64_or_none(content_type_id)
    if pk is not None:
        content_type = ContentType.objects.filter(pk=pk).first()
        model = content_type.model_class() if content_type is not None else None
    if model is None or not hasattr(model, "get_absolute_url"):
        raise Http404("this object has no page on the site")
    return contenttype_views.shortcut(request, content_type_id, object_id)


class AdminSite(admin.AdminSite):
    def admin_view(self, view: Callable[..., HttpResponse], cacheable: bool = False) -> Callable[..., HttpResponse]:
        return super().admin_view(_refusing_nul(view), cacheable)

    def get_urls(self) -> list[URLPattern | URLResolver]:
        return [
            path(str(url.pattern), self.admin_view(_view_on_site), name=url.name)
            if getattr(url, "name", None) == "view_on_site"
            else url
            for url in super().get_urls()
        ]

    def register(
        self,
        model_or_iterable: type[Model] | Iterable[type[Model]],
        admin_class: type[admin.ModelAdmin] | None = None,
        **options: Any,
    ) -> None:
        admin_class = admin_class or admin.ModelAdmin
        if not issubclass(admin_class, CheckedInputAdmin):
            # As Django's own register() does with **options: a subclass made here.
            admin_class = type(
                admin_class.__name__, (CheckedInputAdmin, admin_class), {"__module__": admin_class.__module__}
            )
        super().register(model_or_iterable, admin_class, **options)


class AdminConfig(DjangoAdminConfig):
    default_site = "project.admin_site.AdminSite"
