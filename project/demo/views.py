from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def dashboard(request: HttpRequest) -> HttpResponse:
    """The demo dashboard: live channel values over the realtime WebSocket."""
    return render(request, "demo/dashboard.html")
