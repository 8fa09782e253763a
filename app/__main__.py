from speclens.app.launcher import entry

entry()
