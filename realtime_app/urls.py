"""HTTP routes of realtime_app: ``include("realtime_app.urls")`` under ``realtime/``."""

from django.urls import path

from . import views

app_name = "realtime_app"

urlpatterns = [
    path("api/health", views.health, name="health"),
]
