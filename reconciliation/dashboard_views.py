"""Admin pages outside the model admins: the dashboard (page, HTML fragment, JSON) and
pause/resume of a bot's or a consumer's circuit. All wrapped in admin_site.admin_view."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from bots.models import Bot
from core.ids import int64_or_none
from outbox.circuits import parse_scope
from outbox.models import Circuit
from reconciliation import triage
from reconciliation.admin.confirm import confirm_page
from reconciliation.admin.forms import ReasonForm
from reconciliation.admin.permissions import PAUSE_PERMISSION
from reconciliation.dashboard import dashboard_charts, dashboard_numbers

DASHBOARD_PERMISSION = "reconciliation.view_dashboard"


def _bot_id(request: HttpRequest) -> int | None:
    """The bot `?bot=` names (None: every bot); 400 for what is not an id, 404 for an id no
    bot has."""
    if not request.user.has_perm(DASHBOARD_PERMISSION):
        raise PermissionDenied
    raw = request.GET.get("bot") or ""
    if not raw:
        return None
    bot_id = int64_or_none(raw)
    if bot_id is None:
        raise BadRequest("bot must be a bot's id")
    if not Bot.objects.filter(pk=bot_id).exists():
        raise Http404("no such bot")
    return bot_id


def _context(request: HttpRequest) -> dict:
    bot_id = _bot_id(request)
    numbers = dashboard_numbers(bot_id)
    return {
        **admin.site.each_context(request),
        "title": "Dashboard" + (f" — {Bot.objects.get(pk=bot_id).name}" if bot_id is not None else ""),
        "numbers": numbers,
        "charts": dashboard_charts(numbers),
        "bots": Bot.objects.all(),
        "bot_id": bot_id,
        "can_pause": request.user.has_perm(PAUSE_PERMISSION),
    }


def dashboard(request: HttpRequest) -> TemplateResponse:
    return TemplateResponse(request, "reconciliation/dashboard.html", _context(request))


def dashboard_fragment(request: HttpRequest) -> TemplateResponse:
    return TemplateResponse(request, "reconciliation/_dashboard_body.html", _context(request))


def dashboard_data(request: HttpRequest) -> JsonResponse:
    return JsonResponse(dashboard_numbers(_bot_id(request)))


def circuit(request: HttpRequest, action: str) -> HttpResponse:
    """Pause (open by hand) or resume (close) the circuit of `scope` = bot:<id> | consumer:<name>."""
    if action not in ("pause", "resume"):
        raise Http404
    if not request.user.has_perm(PAUSE_PERMISSION):
        raise PermissionDenied
    scope = request.GET.get("scope") or request.POST.get("scope") or ""
    parsed = parse_scope(scope)
    if parsed is None or (parsed[0] == "bot" and not Bot.objects.filter(pk=parsed[1]).exists()):
        raise Http404("unknown scope")
    form = ReasonForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        if action == "pause":
            triage.circuit_pause(scope, request.user, form.cleaned_data["reason"])
        else:
            triage.circuit_resume(scope, request.user, form.cleaned_data["reason"])
        messages.success(request, f"{scope}: {action}d.")
        if parsed[0] == "bot":
            return HttpResponseRedirect(reverse("admin:bots_bot_change", args=[parsed[1]]))
        return HttpResponseRedirect(reverse("dovecote_dashboard"))
    model_admin = admin.site._registry[Circuit]
    intro = (
        "Opens the circuit by hand: nothing is sent or run for it until an operator resumes; the queue is kept."
        if action == "pause"
        else "Closes the circuit: waiting work flows again (the sweeper dispatches what is overdue)."
    )
    return confirm_page(
        request,
        model_admin,
        title=f"{action.capitalize()} {scope}",
        form=form,
        intro=intro,
        submit=action.capitalize(),
        danger=action == "pause",
    )
