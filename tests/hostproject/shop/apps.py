from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.hostproject.shop"
    label = "shop"
