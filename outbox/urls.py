"""REST API routes, mounted at /api/v1/ (project/urls.py)."""

from django.urls import path

from outbox import api

urlpatterns = [
    path("messages/", api.MessagesView.as_view(), name="api-messages"),
    path("messages/<int:pk>/", api.MessageDetailView.as_view(), name="api-message-detail"),
    path("messages/<int:pk>/cancel/", api.MessageCancelView.as_view(), name="api-message-cancel"),
    path("broadcasts/", api.BroadcastCreateView.as_view(), name="api-broadcast-create"),
]
