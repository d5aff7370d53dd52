"""URLs of the demo site."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from project.demo import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("realtime/", include("realtime_app.urls")),
    path("demo/room/<slug:name>/", views.room, name="demo-room"),
    path("demo/lot/<int:lot_id>/", views.lot, name="demo-lot"),
    path("demo/sse/", views.sse, name="demo-sse"),
    path("demo/htmx/", views.htmx, name="demo-htmx"),
    path("demo/heavy/", views.heavy, name="heavy"),  # in the pool "heavy" (settings.REALTIME_APP)
    path("demo/heavy-unlimited/", views.heavy, name="heavy-unlimited"),
]
