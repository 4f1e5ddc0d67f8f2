from django.urls import path

from bots import views

urlpatterns = [
    path("webhooks/telegram/<str:name>/", views.telegram_webhook, name="telegram-webhook"),
]
