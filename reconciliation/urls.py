"""Back-office pages under /admin/ops/ (mounted before admin.site.urls in project/urls.py)."""

from django.contrib import admin
from django.urls import path

from reconciliation import dashboard_views as views

urlpatterns = [
    path("dashboard/", admin.site.admin_view(views.dashboard), name="dovecote_dashboard"),
    path("dashboard/fragment/", admin.site.admin_view(views.dashboard_fragment), name="dovecote_dashboard_fragment"),
    path("dashboard/data.json", admin.site.admin_view(views.dashboard_data), name="dovecote_dashboard_data"),
    path("circuit/<str:action>/", admin.site.admin_view(views.circuit), name="dovecote_circuit"),
]
