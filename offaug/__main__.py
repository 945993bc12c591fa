from offaug.cli import main

main()
