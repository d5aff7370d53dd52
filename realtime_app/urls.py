"""HTTP routes of realtime_app: ``path("realtime/", include("realtime_app.urls"))``."""

from django.urls import path

from realtime_app import views

app_name = "realtime_app"

urlpatterns = [
    path("api/health", views.health, name="health"),
    path("metrics", views.metrics, name="metrics"),
    path("api/connections/close", views.close_connection, name="close-connection"),
    path("api/token", views.issue_token, name="token"),
    path("api/publish", views.publish_api, name="publish"),
    path("ready", views.ready, name="ready"),
    path("sse", views.http_endpoint, name="sse"),  # served by realtime_app.routing.MetricsShortcut
    path("rpc", views.http_endpoint, name="rpc"),
]
