"""URLs of the tests: the demo site plus the limiter's instrumented views."""

from django.urls import path

from project.urls import urlpatterns as demo_urlpatterns
from tests.testapp import views

urlpatterns = [
    *demo_urlpatterns,
    path("test/limited/", views.limited),
    path("test/limited-sync/", views.limited_sync),
    path("test/limited-raises/", views.limited_raises),
    path("test/limited-stream/", views.limited_stream),
    path("test/limited-stats/", views.stats),
]
