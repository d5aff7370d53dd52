from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("realtime_app", "0002_flush_mark")]

    operations = [
        migrations.AddField(
            model_name="flushmark",
            name="journaled",
            field=models.BooleanField(default=False),
        ),
    ]
