from django.contrib import admin
from django.urls import include, path

from reconciliation import views as ops

urlpatterns = [
    path("admin/ops/", include("reconciliation.urls")),  # before the admin's catch-all
    path("admin/", admin.site.urls),
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
    path("metrics", ops.metrics, name="metrics"),
    path("", include("bots.urls")),
]
