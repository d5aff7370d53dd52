from django.conf import settings
from django.db import migrations, models

LOTS = 1000


def make_lots(apps, schema_editor):
    lot = apps.get_model("demo", "AuctionLot")
    lot.objects.using(schema_editor.connection.alias).bulk_create([lot(pk=i) for i in range(1, LOTS + 1)])


class Migration(migrations.Migration):
    dependencies = [
        ("demo", "0001_inventory"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="AuctionLot",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("price", models.PositiveIntegerField(default=0)),
                ("bids", models.PositiveIntegerField(default=0)),
            ],
        ),
        migrations.CreateModel(
            name="RoomMessage",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("room", models.SlugField(max_length=64)),
                ("text", models.CharField(max_length=500)),
                ("created", models.DateTimeField(auto_now_add=True)),
                (
                    "user",
                    models.ForeignKey(on_delete=models.deletion.CASCADE, to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
        migrations.RunPython(make_lots, migrations.RunPython.noop),
    ]
